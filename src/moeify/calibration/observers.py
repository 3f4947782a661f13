"""Running statistics gathered layer by layer, in memory independent of the number of tokens."""

from __future__ import annotations

import torch
from torch import Tensor


class CoActivation:
    """MoRE §2.2 for one MLP of width m: the activation channel sets S(t) = TopK(|h(t)|, k_act)
    (Eq. 3-4), their frequency f (Eq. 5) and co-activation matrix C (Eq. 6), and the mean squares
    E[x^2], E[h^2] of the importance score (Eq. 7). Memory O(m^2 + d), never O(tokens)."""

    def __init__(self, hidden_size: int, width: int, k_act: int) -> None:
        self.k_act = k_act
        self.tokens = 0
        self._counts = torch.zeros(width, dtype=torch.float64)
        self._co = torch.zeros(width, width, dtype=torch.float64)
        self._x_sq = torch.zeros(hidden_size, dtype=torch.float64)
        self._h_sq = torch.zeros(width, dtype=torch.float64)

    def update(self, x: Tensor, h: Tensor) -> None:
        """x: (tokens, d) MLP inputs; h: (tokens, m) their hidden activations."""
        x, h = x.reshape(-1, x.shape[-1]).double().cpu(), h.reshape(-1, h.shape[-1]).double().cpu()
        marks = torch.zeros_like(h).scatter_(1, h.abs().topk(self.k_act, dim=1).indices, 1.0)  # 1[i in S(t)]
        self._counts += marks.sum(0)
        self._co += marks.T @ marks
        self._x_sq += x.pow(2).sum(0)
        self._h_sq += h.pow(2).sum(0)
        self.tokens += x.shape[0]

    @property
    def frequency(self) -> Tensor:
        """f (m,), sums to k_act; Eq. 5."""
        return self._counts / self.tokens

    @property
    def coactivation(self) -> Tensor:
        """C (m, m); Eq. 6."""
        return self._co / self.tokens

    @property
    def mean_x_sq(self) -> Tensor:
        return self._x_sq / self.tokens

    @property
    def mean_h_sq(self) -> Tensor:
        return self._h_sq / self.tokens
