"""What every router returns: a flat list of (token, expert, weight) triples sorted by expert, plus
per-expert counts (``expert_counts``: of fixed shape, without a host sync). Part of the runtime copied into
every converted folder (imports torch only)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


def expert_counts(expert: Tensor, num_experts: int) -> Tensor:
    """(num_experts,) pairs per expert: a scatter-add on an asynchronous device and in a graph, where
    ``torch.bincount`` would read the largest id back to the host to size its output (a device sync, and a
    graph break under ``torch.compile``); ``bincount`` on a CPU, where there is nothing to wait for and one
    operation costs less than three (at a decode step each operation's fixed cost is what counts)."""
    if expert.device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.bincount(expert, minlength=num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert.device)
    return counts.scatter_add_(0, expert, torch.ones_like(expert))


@dataclass(frozen=True)
class Dispatch:
    """What every router returns. ``token``/``expert``/``weight`` are (n_pairs,) sorted by expert;
    ``counts`` is (num_experts,) with the number of pairs per expert. A top-k router's dispatch also
    has ``top_k`` and ``slot``: each pair's index in the flattened (tokens, k) choice matrix, so that
    the expert outputs can be summed per token in slot order, as transformers does. ``real``, where set,
    marks the pairs that were chosen: the others follow them, weigh 0 and lie past the last expert's group
    (``from_mask`` where ``lists_every_pair``: a compiled graph, inference on a GPU)."""

    token: Tensor
    expert: Tensor
    weight: Tensor
    counts: Tensor
    top_k: int | None = None
    slot: Tensor | None = None
    real: Tensor | None = None

    @staticmethod
    def from_topk(indices: Tensor, weights: Tensor, num_experts: int) -> "Dispatch":
        """indices, weights: (tokens, k) -> flat pairs sorted by expert with ``torch.sort``, the sort of
        transformers' MoE experts (which order tokens within an expert's group changes float32 sums)."""
        k = indices.shape[1]
        flat_expert = indices.reshape(-1)
        expert, slot = torch.sort(flat_expert)
        return Dispatch(token=slot // k if k > 1 else slot, expert=expert, weight=weights.reshape(-1)[slot],
                        counts=expert_counts(flat_expert, num_experts), top_k=k, slot=slot)

    @staticmethod
    def from_mask(active: Tensor, weights: Tensor) -> "Dispatch":
        """active: (tokens, experts) bool, any number of experts per token (none included); weights:
        (tokens, experts), read where active -> flat pairs sorted by expert (then token). Where the number of
        chosen pairs may not be read back (``lists_every_pair``), every (token, expert) pair is listed, the
        chosen ones first in the same order (``real``)."""
        if lists_every_pair(active):
            return Dispatch._every_pair(active, weights)
        expert, token = active.T.nonzero(as_tuple=True)  # row-major order of (expert, token): sorted by expert
        return Dispatch(token=token, expert=expert, weight=weights[token, expert],
                        counts=expert_counts(expert, active.shape[1]))

    @staticmethod
    def _every_pair(active: Tensor, weights: Tensor) -> "Dispatch":
        """``from_mask`` with a fixed number of pairs, tokens x experts: a stable sort of the pairs in (expert,
        token) order by their expert, the pairs not chosen keyed past the last expert. Every pair is listed
        once, so the dispatch is a top-k one with k = experts (``slot``: the pair's place in the (tokens,
        experts) matrix): the outputs are summed per token by a gather and a sum, where adding them into the
        tokens' rows (``index_add``) would take atomic adds of the experts' outputs into each row on a GPU."""
        tokens, experts = active.shape
        ids = torch.arange(experts, device=active.device)
        key = torch.where(active, ids, experts).T.reshape(-1)  # (expert, token) order
        key, order = torch.sort(key, stable=True)
        expert, token = order // tokens, order % tokens
        return Dispatch(token=token, expert=expert, weight=weights.T.reshape(-1)[order] * (key < experts),
                        counts=active.sum(dim=0), top_k=experts, slot=token * experts + expert, real=key < experts)

    def chosen(self) -> "Dispatch":
        """The chosen pairs alone (they come first): a host sync, for a path that reads the counts back anyway
        (the per-expert path sizes its slices by them)."""
        if self.real is None:
            return self
        n = int(self.counts.sum())
        return replace(self, token=self.token[:n], expert=self.expert[:n], weight=self.weight[:n], real=None,
                       top_k=None, slot=None)


def lists_every_pair(active: Tensor) -> bool:
    """Whether ``Dispatch.from_mask`` lists every (token, expert) pair rather than the chosen ones: inside a
    compiled graph, whose shapes may not depend on the data, and at inference on an asynchronous device (a
    GPU), where ``nonzero`` would stall the host until the device has computed the mask, to size its output.
    The listed pairs cost a gather of tokens x experts rows; the grouped matmuls still compute the chosen
    pairs only (the rest lie past the last expert's group). A CPU computes the mask before ``nonzero`` asks
    anyway, and training reads the counts back to size each expert's slice: both keep the chosen pairs."""
    return torch.compiler.is_compiling() or (active.device.type != "cpu" and not torch.is_grad_enabled())
