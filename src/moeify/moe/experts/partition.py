"""Which hidden neurons form the always-on shared part and each routed expert, and the pure functions
that decide it (house rule: maths is plain functions of tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moeify.moe.experts.balanced_assignment import balanced_assignment

__all__ = ["ExpertPartition", "balanced_assignment", "balanced_kmeans", "even_sizes", "random_partition"]


@dataclass(frozen=True)
class ExpertPartition:
    """``shared``: neuron indices always on; ``experts``: one index tensor per routed expert.
    Sizes may differ; the parts are disjoint."""

    shared: Tensor
    experts: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        parts = [self.shared, *self.experts]
        every = torch.cat(parts)
        if every.unique().numel() != every.numel():
            raise ValueError("an ExpertPartition's shared part and experts must be disjoint")
        if any(e.numel() == 0 for e in self.experts):
            raise ValueError("every routed expert needs at least one neuron")

    @property
    def num_neurons(self) -> int:
        return sum(p.numel() for p in (self.shared, *self.experts))

    def covers(self, intermediate_size: int) -> bool:
        """True when every neuron 0..d_h-1 is in exactly one part (nothing dropped)."""
        return self.num_neurons == intermediate_size and \
            torch.equal(torch.cat([self.shared, *self.experts]).sort().values, torch.arange(intermediate_size))


def even_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` sizes differing by at most one, larger first: 172 into 8 gives
    [22, 22, 22, 22, 21, 21, 21, 21]. Used when d_h is not a multiple of the expert count, so that no
    neuron is dropped."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def balanced_kmeans(features: Tensor, init_centroids: Tensor, capacities: list[int], *,
                    max_iter: int) -> tuple[Tensor, Tensor, int]:
    """Balanced k-means of CMoE (Eq. 10-14, after Malinen & Fränti): each iteration solves the cluster
    assignment exactly (every cluster p gets exactly ``capacities[p]`` rows, minimum total L2 distance,
    Eq. 11/13), then moves each centroid to its members' mean (Eq. 12/14); stops when the assignment no
    longer changes or after ``max_iter`` iterations.

    features: (n, q) one row per neuron (its activation markers over q tokens); init_centroids: (k, q).
    Returns (labels (n,), centroids (k, q), iterations run).
    """
    feats = features.float().contiguous()  # (n, q) row-major: the matmuls below stream it once
    sq_norms = feats.pow(2).sum(dim=1, keepdim=True)  # |c_i|^2, reused by every distance evaluation
    centroids = init_centroids.float().clone()
    sizes = torch.tensor(capacities, dtype=feats.dtype, device=feats.device)[:, None]
    labels = None
    iterations = 0
    for iterations in range(1, max_iter + 1):
        # d_{i,p} = ||c_i - c^_p||_2 (Eq. 10), as |c|^2 + |c^|^2 - 2 c.c^ (one matmul; cdist is slow here)
        sq = sq_norms + centroids.pow(2).sum(dim=1) - 2 * feats @ centroids.T  # (n, k)
        new_labels = balanced_assignment(sq.clamp_min_(0).sqrt_(), capacities)  # Eq. 11 / 13
        if labels is not None and torch.equal(new_labels, labels):
            break
        labels = new_labels
        members = torch.nn.functional.one_hot(labels, len(capacities)).T.to(feats.dtype)  # (k, n)
        centroids = members @ feats / sizes  # Eq. 12 / 14: member means (clusters are never empty)
    return labels, centroids, iterations


def random_partition(neurons: Tensor, sizes: list[int], generator: torch.Generator) -> tuple[Tensor, ...]:
    """LLaMA-MoE-style random split of ``neurons`` into groups of the given sizes."""
    shuffled = neurons[torch.randperm(neurons.numel(), generator=generator)]
    return tuple(part.sort().values for part in shuffled.split(sizes))
