"""Training losses over a large vocabulary, computed a chunk of tokens at a time.

A (tokens x vocabulary) float32 matrix is what makes LLM training run out of memory first: 2,048 tokens
of a 49,152-word vocabulary are 0.4 GB, and a plain ``model(labels=...)`` holds the logits, their
log-softmax and, in the backward pass, their gradients at once. Here the final hidden states are run
through the output head ``CHUNK_TOKENS`` tokens at a time, each chunk under activation checkpointing
(its logits are recomputed in the backward pass), so at most one chunk's logits exist at any moment:
the same loss, up to float32 summation order.

The losses read the final hidden states from the model's base model and apply its output embedding, as
every causal-LM family moeify supports computes its logits, with the transforms some families apply
after the head: Granite's division by ``config.logits_scaling`` and Gemma-2/3's soft-capping
(``config.final_logit_softcapping``: cap * tanh(logits / cap)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 1024


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside an adapter wrapper (peft's ``PeftModel``), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def final_hidden_states(model: nn.Module, batch: Tensor) -> Tensor:
    """The decoder's output (after its final norm) for ``batch``: (batch, seq, d)."""
    return _causal_lm(model).base_model(input_ids=batch, use_cache=False).last_hidden_state


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
    causal = _causal_lm(model)
    head = causal.get_output_embeddings()
    scaling = getattr(causal.config, "logits_scaling", 1.0) or 1.0
    cap = getattr(causal.config, "final_logit_softcapping", None) or None
    return head if scaling == 1.0 and cap is None else _TransformedHead(head, scaling, cap)


def _chunk_cross_entropy(head: nn.Module, hidden: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def _chunk_kl(head: nn.Module, teacher: Tensor, student: Tensor) -> Tensor:
    with torch.no_grad():
        t = torch.log_softmax(head(teacher).float(), dim=-1)
    s = torch.log_softmax(head(student).float(), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="sum")


def chunked(fn: Callable[..., Tensor], head: nn.Module, *tensors: Tensor) -> Tensor:
    """The sum of ``fn(head, *chunk)`` over chunks of ``CHUNK_TOKENS`` rows of ``tensors`` (all (N, ...)),
    each chunk checkpointed so that its logits are freed after its forward and rebuilt for its backward."""
    total = tensors[0].new_zeros((), dtype=torch.float32)
    for parts in zip(*(t.split(CHUNK_TOKENS) for t in tensors)):
        if torch.is_grad_enabled():
            total = total + checkpoint(fn, head, *parts, use_reentrant=False)
        else:
            total = total + fn(head, *parts)
    return total


def lm_loss(model: nn.Module, batch: Tensor) -> dict[str, Tensor]:
    """Next-token cross-entropy, the mean over the batch's predicted tokens."""
    hidden = final_hidden_states(model, batch)[:, :-1].flatten(0, 1)  # (N, d): positions that predict
    targets = batch[:, 1:].flatten()
    return {"loss": chunked(_chunk_cross_entropy, output_head(model), hidden, targets) / targets.numel()}


def distillation_kl(model: nn.Module, teacher_hidden: Tensor, student_hidden: Tensor) -> Tensor:
    """KL(p_teacher || p_student) per token, averaged over tokens, from the two runs' final hidden states
    (batch, seq, d) through the model's output head (the teacher's side without gradients)."""
    teacher, student = teacher_hidden.flatten(0, -2), student_hidden.flatten(0, -2)
    return chunked(_chunk_kl, output_head(model), teacher, student) / teacher.shape[0]
