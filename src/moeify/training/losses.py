"""Training losses over a large vocabulary, computed a chunk of tokens at a time.

A (tokens x vocabulary) float32 matrix is what makes LLM training run out of memory first: 2,048 tokens
of a 49,152-word vocabulary are 0.4 GB, and a plain ``model(labels=...)`` holds the logits, their
log-softmax and, in the backward pass, their gradients at once. Here the final hidden states are run
through the output head ``CHUNK_TOKENS`` tokens at a time, each chunk under activation checkpointing
(its logits are recomputed in the backward pass), so at most one chunk's logits exist at any moment:
the same loss, up to float32 summation order.

The losses read the final hidden states from the model's base model and apply its output head as the
model computes its logits (``arch.head``: the output embedding, then Granite's logit scaling or
Gemma's soft-capping).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from moeify.arch.head import final_hidden_states, output_head

CHUNK_TOKENS = 1024


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
