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
from functools import partial

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
    """The sum of ``fn(head, *chunk)`` (a scalar or a vector of sums) over chunks of ``CHUNK_TOKENS`` rows of
    ``tensors`` (all (N, ...)), each chunk checkpointed so that its logits are freed after its forward and
    rebuilt for its backward."""
    total: Tensor | None = None
    for parts in zip(*(t.split(CHUNK_TOKENS) for t in tensors)):
        if torch.is_grad_enabled():
            value = checkpoint(fn, head, *parts, use_reentrant=False)
        else:
            value = fn(head, *parts)
        total = value if total is None else total + value
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


def top_k_targets(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """A teacher's distribution kept as its ``k`` likeliest tokens: (log-probabilities (n, k), their ids
    (n, k), the log of the probability mass of every other token (n,)), from logits (n, vocabulary)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top, ids = logp.topk(k, dim=-1)
    tail = logp.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)
    return top, ids, tail


def _weighted(student_logp: Tensor, kl: Callable[[], Tensor], targets: Tensor, w_kl: float, w_lm: float) -> Tensor:
    """(w_kl KL + w_lm cross-entropy, KL sum, cross-entropy sum) of a chunk; a part of weight 0 is computed
    without gradients (for the log only), so its backward costs nothing. Targets of -100 are not scored."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and w_kl > 0):
        kl_sum = kl()
    with torch.set_grad_enabled(torch.is_grad_enabled() and w_lm > 0):
        lm_sum = F.nll_loss(student_logp, targets, ignore_index=-100, reduction="sum")
    return torch.stack([w_kl * kl_sum + w_lm * lm_sum, kl_sum.detach(), lm_sum.detach()])


def _chunk_full_kl(teacher_head: nn.Module, w_kl: float, w_lm: float, head: nn.Module, student: Tensor,
                   teacher: Tensor, targets: Tensor) -> Tensor:
    with torch.no_grad():
        t = torch.log_softmax(teacher_head(teacher).float(), dim=-1)
    s = torch.log_softmax(head(student).float(), dim=-1)
    return _weighted(s, lambda: F.kl_div(s, t, log_target=True, reduction="sum"), targets, w_kl, w_lm)


def _chunk_top_k_kl(w_kl: float, w_lm: float, head: nn.Module, student: Tensor, top: Tensor, ids: Tensor,
                    tail: Tensor, targets: Tensor) -> Tensor:
    """KL of the bucketed distributions: the teacher's k tokens one by one, every other token one bucket
    (exact for that coarser distribution, so it is 0 only where the student matches the teacher on it)."""
    s = torch.log_softmax(head(student).float(), dim=-1)

    def kl() -> Tensor:
        s_top = s.gather(-1, ids)
        s_tail = s.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)
        p_tail = tail.exp()
        return (top.exp() * (top - s_top)).sum() + torch.xlogy(p_tail, p_tail).sum() - (p_tail * s_tail).sum()

    return _weighted(s, kl, targets, w_kl, w_lm)


def next_token_targets(batch: Tensor) -> Tensor:
    """Each position's next token, -100 at the last position (it predicts beyond the window): (N,)."""
    return torch.cat([batch[:, 1:], batch.new_full((batch.shape[0], 1), -100)], dim=1).flatten()


def distillation_loss(model: nn.Module, batch: Tensor, teacher: tuple[Tensor, ...], *, lm_share: float,
                      teacher_head: nn.Module | None = None) -> dict[str, Tensor]:
    """(1 - lm_share) KL(teacher || student) + lm_share x next-token cross-entropy, each a mean per token.

    ``teacher``: the teacher's final hidden states (batch, seq, d), whose logits ``teacher_head`` gives
    (the whole vocabulary), or its top-k targets (``top_k_targets``: (batch, seq, k) log-probabilities,
    (batch, seq, k) ids, (batch, seq) tail mass). Every position is distilled; the last one has no next
    token for the cross-entropy."""
    hidden = final_hidden_states(model, batch).flatten(0, 1)
    targets = next_token_targets(batch)
    flat = [t.flatten(0, 1) for t in teacher]
    tokens, predicted = hidden.shape[0], batch.shape[0] * (batch.shape[1] - 1)
    weights = ((1 - lm_share) / tokens, lm_share / predicted)
    if len(teacher) == 1:
        sums = chunked(partial(_chunk_full_kl, teacher_head, *weights), output_head(model), hidden, flat[0], targets)
    else:
        sums = chunked(partial(_chunk_top_k_kl, *weights), output_head(model), hidden, *flat, targets)
    return {"loss": sums[0], "kl": sums[1] / tokens, "lm": sums[2] / predicted}
