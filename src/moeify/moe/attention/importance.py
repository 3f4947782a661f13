"""Activation-aware importance of attention head dimensions, for static head-dimension pruning.

Every head keeps the same dimensions (``runtime.attention.PrunedAttention``), so each score sums over
heads. Statistics are the mean squares of the q/k/v projection outputs (biases included, before RoPE)
per (head, head dimension), gathered with forward hooks during one calibration pass; memory is
O(heads x head_dim), independent of the number of tokens.

- Query/key RoPE pair j (dimensions j and j + hd/2, kept or dropped together, ToMoE Appendix A.2):
  s_j = sum_h E_t[q_hj^2 + q_h(j+hd/2)^2] * E_t[k_gj^2 + k_g(j+hd/2)^2], g the key/value head of query
  head h. The pair adds q_pair . R k_pair to the attention logit, R the rotation by the pair's angle
  times the relative position; averaged over that angle its square is |q_pair|^2 |k_pair|^2 / 2 (and
  never more than twice that, Cauchy-Schwarz). RoPE keeps each pair's norm, so pre-RoPE statistics are
  exact for it. Averaging queries and keys separately treats query and key positions as independent,
  which they are not exactly, but a product of means needs no (tokens x tokens) statistic. (Centring the
  keys, which discounts logit shifts the softmax ignores, chose worse pairs on stories260K.)
- Value/output dimension j: s_j = sum_h E_t[v_gj^2] * ||W_o[:, (h, j)]||^2, the Wanda-style
  |weight| x |activation| analogue (as MLP channels, ``moe.experts.importance``): a head's attention output is
  a convex mixture of its values, so E[v^2] stands in for the output's scale at that dimension.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from moeify.moe.attention.head_dim import rope_pairs


class HeadDimSquares:
    """Running E[q^2] (heads, hd), E[k^2] and E[v^2] (kv_heads, hd) of one attention's projections."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.head_dim = head_dim
        self.groups = num_heads // num_kv_heads  # query heads per key/value head (GQA)
        shapes = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        self._sums = {name: torch.zeros(heads, head_dim, dtype=torch.float64) for name, heads in shapes.items()}
        self._tokens = dict.fromkeys(shapes, 0)

    def update(self, name: str, out: Tensor) -> None:
        """``out`` (..., heads x hd): the output of the ``name`` ("q", "k" or "v") projection."""
        heads = self._sums[name].shape[0]
        flat = out.detach().reshape(-1, heads, self.head_dim).double()  # (tokens, heads, hd)
        self._sums[name] += flat.pow(2).sum(0).cpu()
        self._tokens[name] += flat.shape[0]

    def mean(self, name: str) -> Tensor:
        return self._sums[name] / self._tokens[name]


@contextmanager
def observe_head_dims(projections: dict[str, nn.Linear], head_dim: int) -> Iterator[HeadDimSquares]:
    """Hooks on an attention's q/k/v projections (by role, ``DecoderAdapter.attention_projections``;
    LLaMA-style, see ``moe.attention.head_dim.head_dim_support``) that fill the yielded ``HeadDimSquares`` while
    the block runs; removed even when an exception escapes."""
    squares = HeadDimSquares(projections["q"].out_features // head_dim, projections["k"].out_features // head_dim,
                             head_dim)
    handles = [projections[name].register_forward_hook(
        lambda _module, _args, out, name=name: squares.update(name, out)) for name in ("q", "k", "v")]
    try:
        yield squares
    finally:
        for handle in handles:
            handle.remove()


def _pairs(mean_sq: Tensor) -> Tensor:
    """(heads, hd) -> (heads, hd/2): the squared norm of every RoPE pair (j, j + hd/2)."""
    half = mean_sq.shape[-1] // 2
    return mean_sq[:, :half] + mean_sq[:, half:]


def qk_pair_importance(squares: HeadDimSquares) -> Tensor:
    """(hd/2,) float64 score of each query/key RoPE pair (see the module docstring)."""
    keys = _pairs(squares.mean("k")).repeat_interleave(squares.groups, dim=0)  # (heads, hd/2), query head order
    return (_pairs(squares.mean("q")) * keys).sum(0)


def vo_dim_importance(squares: HeadDimSquares, o_weight: Tensor) -> Tensor:
    """(hd,) float64 score of each value/output dimension; ``o_weight`` (d, heads x hd) is the output
    projection's weight."""
    values = squares.mean("v").repeat_interleave(squares.groups, dim=0)  # (heads, hd)
    columns = o_weight.detach().double().pow(2).sum(0).cpu().view(values.shape)  # ||W_o[:, (h, j)]||^2
    return (values * columns).sum(0)


def static_head_dims(squares: HeadDimSquares, o_weight: Tensor, keep_ratio: float) -> tuple[Tensor, Tensor]:
    """(qk_index, vo_index) keeping the share ``keep_ratio`` of the head dimension in Q/K (whole RoPE
    pairs: round(r x hd/2) of them) and in V/O (round(r x hd) dimensions), at least one of each."""
    hd = squares.head_dim
    pairs = qk_pair_importance(squares).argsort(descending=True)[:max(1, round(keep_ratio * hd / 2))]
    dims = vo_dim_importance(squares, o_weight).argsort(descending=True)[:max(1, round(keep_ratio * hd))]
    return rope_pairs(pairs, hd), dims.sort().values
