"""Where a carved layer loses: the partition or the router.

Per layer, on (a subsample of) its calibration tokens, the relative MLP output error
||F_MoE(x) - F(x)||^2 / ||F(x)||^2 of

- ``router``: the experts the router picks (with the configured score reading),
- ``router_<other>``: the other reading of Eq. 25-26 (signed h_R against |h_R|),
- ``oracle``: the best ``top_k`` routed experts for each token (what a perfect router would reach with
  this partition; exact over every subset when there are at most ``EXACT_SUBSETS`` of them, greedy
  otherwise),
- ``static``: static pruning at the same share, the shared neurons plus ``top_k`` experts' worth of
  channels chosen once for all tokens by activation-aware importance (MoRE Eq. 7 / Wanda, the
  static-pruning baseline's score).

A router far above the oracle loses in routing; an oracle near or above static pruning means the
partition itself gives dynamic selection nothing to win.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from moeify.arch.mlp import MlpWeights
from moeify.calibration.observers import MeanSquares
from moeify.moe.experts.importance import channel_importance
from moeify.moe.experts.partition import ExpertPartition

EXACT_SUBSETS = 1024
MAX_TOKENS = 2048


def _kept_error(outs: Tensor, chosen: Tensor) -> Tensor:
    """Per token, ||sum of the experts not chosen||^2: outs (q, E, d), chosen (q, k) -> (q,)."""
    dropped = outs.sum(1) - outs.gather(1, chosen[..., None].expand(-1, -1, outs.shape[-1])).sum(1)
    return dropped.pow(2).sum(-1)


def _oracle_error(outs: Tensor, k: int) -> tuple[Tensor, str]:
    """Per token, the least error over the choices of ``k`` experts: (q,), and "exact" or "greedy"."""
    n = outs.shape[1]
    total = outs.sum(1)
    if math.comb(n, k) <= EXACT_SUBSETS:
        # ||R - sum_S o_e||^2 = |R|^2 - 2 sum_S <R, o_e> + sum_{e, f in S} <o_e, o_f>
        subsets = torch.tensor(list(itertools.combinations(range(n), k)))  # (C, k)
        gram = outs @ outs.transpose(1, 2)  # (q, E, E)
        cross = (outs @ total[..., None]).squeeze(-1)  # (q, E)
        pair = gram[:, subsets[:, :, None], subsets[:, None, :]].sum((-1, -2))  # (q, C)
        errors = total.pow(2).sum(-1, keepdim=True) - 2 * cross[:, subsets].sum(-1) + pair
        return errors.min(dim=1).values.clamp_min(0), "exact"
    residual, used = total.clone(), torch.zeros(outs.shape[:2], dtype=torch.bool)
    for _ in range(k):  # add the expert that removes the most error, one at a time
        errors = (residual[:, None] - outs).pow(2).sum(-1).masked_fill(used, math.inf)
        best = errors.argmin(1)
        used[torch.arange(len(best)), best] = True
        residual = residual - outs[torch.arange(len(best)), best]
    return residual.pow(2).sum(-1), "greedy"


@torch.no_grad()
def routing_errors(mlp: MlpWeights, partition: ExpertPartition, representatives: Tensor, top_k: int,
                   score: str, x: Tensor) -> dict[str, float | str]:
    """The relative errors of the module docstring on up to ``MAX_TOKENS`` evenly spaced rows of x (q, d)."""
    x = x[torch.linspace(0, len(x) - 1, min(len(x), MAX_TOKENS)).long()].float()
    mlp = mlp.to(dtype=torch.float32)
    hidden = mlp.hidden(x)
    dense = torch.nn.functional.linear(hidden, mlp.down)  # the output bias is in both, so it cancels
    scale = dense.pow(2).sum()
    outs = torch.stack([torch.nn.functional.linear(hidden[:, e], mlp.down[:, e]) for e in partition.experts], 1)
    rep = hidden[:, representatives]
    readings = {"abs": rep.abs(), "signed": rep}
    other = "signed" if score == "abs" else "abs"
    oracle, how = _oracle_error(outs, top_k)
    squares = MeanSquares(mlp.hidden_size, mlp.intermediate_size)
    squares.update(x, hidden)
    sizes = sorted((e.numel() for e in partition.experts), reverse=True)
    count = partition.shared.numel() + round(top_k * sum(sizes) / len(sizes))
    keep = channel_importance(mlp, squares).argsort(descending=True)[:count].to(x.device)
    static = dense - torch.nn.functional.linear(hidden[:, keep], mlp.down[:, keep])
    relative = lambda err: round(float(err.sum() / scale), 5)  # noqa: E731
    return {"router": relative(_kept_error(outs, readings[score].topk(top_k, dim=1).indices)),
            f"router_{other}": relative(_kept_error(outs, readings[other].topk(top_k, dim=1).indices)),
            "oracle": relative(oracle), "oracle_search": how, "static": relative(static.pow(2).sum(-1))}


def routing_summary(per_layer: list[dict[str, float | str]]) -> dict[str, object]:
    """The per-layer errors and their means over layers (the record's ``details.analysis``)."""
    keys = [k for k, v in per_layer[0].items() if isinstance(v, float)]
    means = {k: round(sum(float(layer[k]) for layer in per_layer) / len(per_layer), 5) for k in keys}
    return {"what": "relative MLP output error ||F_MoE(x) - F(x)||^2 / ||F(x)||^2 on calibration tokens",
            "mean": means, "layers": per_layer}
