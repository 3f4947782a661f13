"""How a causal LM turns its decoder's output into logits, for code that computes them a chunk of tokens at
a time (training losses, perplexity): a (tokens x vocabulary) float32 matrix is what runs out of memory
first on real vocabularies (2,048 tokens of a 49,152-word vocabulary are 0.4 GB).

Every supported family applies its output embedding to the final hidden states, then some transform the
logits: Granite divides them by ``config.logits_scaling``, Gemma-2/3 soft-cap them
(``config.final_logit_softcapping``: cap * tanh(logits / cap)). ``output_head`` includes both.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside an adapter wrapper (peft's ``PeftModel``), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def final_hidden_states(model: nn.Module, batch: Tensor) -> Tensor:
    """The decoder's output (after its final norm) for ``batch``: (batch, seq, d)."""
    return causal_lm(model).base_model(input_ids=batch, use_cache=False).last_hidden_state


class _TransformedHead(nn.Module):
    """``head``, then the division by ``scaling`` and the soft-capping cap * tanh(logits / cap) (if any)."""

    def __init__(self, head: nn.Module, scaling: float, cap: float | None) -> None:
        super().__init__()
        self.head, self.scaling, self.cap = head, scaling, cap

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden) / self.scaling
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap


def output_head(model: nn.Module) -> nn.Module:
    """The module that turns final hidden states into the model's logits."""
    causal = causal_lm(model)
    head = causal.get_output_embeddings()
    scaling = getattr(causal.config, "logits_scaling", 1.0) or 1.0
    cap = getattr(causal.config, "final_logit_softcapping", None) or None
    return head if scaling == 1.0 and cap is None else _TransformedHead(head, scaling, cap)
