"""Running statistics gathered layer by layer, in memory independent of the number of tokens."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

EXACT_FLOAT32 = 2**24  # integers float32 holds exactly


class MeanSquares:
    """E[x^2] (d,) of MLP inputs and E[h^2] (m,) of hidden activations: the activation statistics of
    Wanda-style importance (MoRE Eq. 7). Memory O(d + m)."""

    def __init__(self, hidden_size: int, width: int) -> None:
        self.tokens = 0
        self._x_sq = torch.zeros(hidden_size, dtype=torch.float64)
        self._h_sq = torch.zeros(width, dtype=torch.float64)

    def update(self, x: Tensor, h: Tensor) -> None:
        """x: (..., d) MLP inputs; h: (..., m) their hidden activations."""
        self._x_sq += x.reshape(-1, x.shape[-1]).double().pow(2).sum(0).cpu()
        self._h_sq += h.reshape(-1, h.shape[-1]).double().pow(2).sum(0).cpu()
        self.tokens += x.reshape(-1, x.shape[-1]).shape[0]

    @property
    def mean_x_sq(self) -> Tensor:
        return self._x_sq / self.tokens

    @property
    def mean_h_sq(self) -> Tensor:
        return self._h_sq / self.tokens


class CoActivation:
    """MoRE §2.2 for one MLP of width m: the activation channel sets S(t) = TopK(|h(t)|, k_act)
    (Eq. 3-4), their frequency f (Eq. 5) and co-activation matrix C (Eq. 6), and the mean squares
    E[x^2], E[h^2] of the importance score (Eq. 7). Memory O(m^2 + d), never O(tokens).

    The counts accumulate where the activations are (the work device): C grows by an (m, tokens) x
    (tokens, m) product per batch, a GEMM that a GPU runs far faster than the host, and the batch's
    (tokens, m) activations never cross to the host. Only the restriction that MoRE clusters does
    (``coactivation_among``): its top eigenvectors and k-means run on the host (scipy), the eigenvectors by
    Lanczos iterations of O(n^2) each rather than an O(n^3) decomposition (their times side by side:
    ``benchmarks/results/bench_spectral.jsonl``). They accumulate in
    float32, exact integers up to 2^24 tokens (then float64): half the memory of float64 at the same
    values, which matters at m = 11,008 (0.5 GB)."""

    def __init__(self, hidden_size: int, width: int, k_act: int) -> None:
        self.k_act, self.width = k_act, width
        self.squares = MeanSquares(hidden_size, width)
        self._counts = torch.zeros(width, dtype=torch.float64)
        self._co: Tensor | None = None  # allocated on the device of the first batch

    @property
    def tokens(self) -> int:
        return self.squares.tokens

    def update(self, x: Tensor, h: Tensor) -> None:
        """x: (tokens, d) MLP inputs; h: (tokens, m) their hidden activations."""
        self.squares.update(x, h)
        h = h.reshape(-1, h.shape[-1]).float()
        if self._co is None:
            self._co = torch.zeros(self.width, self.width, dtype=torch.float32, device=h.device)
            self._counts = self._counts.to(h.device)
        if self.tokens > EXACT_FLOAT32 and self._co.dtype == torch.float32:
            self._co = self._co.double()
        marks = torch.zeros_like(h).scatter_(1, h.abs().topk(self.k_act, dim=1).indices, 1.0)  # 1[i in S(t)]
        self._counts += marks.sum(0).double()
        self._co += (marks.T @ marks).to(self._co.dtype)

    def _counts_matrix(self) -> Tensor:
        return self._co if self._co is not None else torch.zeros(self.width, self.width)

    @property
    def frequency(self) -> Tensor:
        """f (m,), sums to k_act; Eq. 5 (on the host)."""
        return self._counts.cpu() / self.tokens

    @property
    def never_activated(self) -> int:
        """Channels no token had among its top-k_act (App. D.2, Table 4: channel concentration)."""
        return int((self._counts == 0).sum())

    @property
    def coactivation(self) -> Tensor:
        """C (m, m) in float64, on the host; Eq. 6."""
        return self._counts_matrix().cpu().double() / self.tokens

    def coactivation_among(self, channels: Tensor) -> np.ndarray:
        """C restricted to ``channels`` with its diagonal zeroed (float64, the graph MoRE clusters on the host),
        built with one float64 copy of the restriction only."""
        co = self._counts_matrix()
        channels = channels.to(co.device)
        restricted = co[channels[:, None], channels].cpu().numpy().astype(np.float64)
        restricted /= self.tokens
        np.fill_diagonal(restricted, 0.0)
        return restricted
