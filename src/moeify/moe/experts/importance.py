"""Activation-aware importance of MLP channels (shared by MoRE's backbone and the static-pruning
baseline)."""

from __future__ import annotations

from torch import Tensor

from moeify.arch.mlp import MlpWeights
from moeify.calibration.observers import MeanSquares


def channel_importance(mlp: MlpWeights, squares: MeanSquares) -> Tensor:
    """s_j = sum_i |W_up[j,i]| E[x_i^2] + sum_k |W_down[k,j]| E[h_j^2]  (MoRE Eq. 7, after Wanda): how
    strongly channel j takes part in the MLP's computation. Written for the up projection; gated MLPs
    use W_up alone, as MoRE does ("we will not consider gate projections"). Returns (m,) float64."""
    up, down = mlp.up.double().abs().cpu(), mlp.down.double().abs().cpu()
    return up @ squares.mean_x_sq + down.sum(0) * squares.mean_h_sq
