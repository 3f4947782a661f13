"""MoRE's layer selection and compression budget (§E.4, Appendix F.2).

PR = 1 - APR with APR = (P_attn + E[P_act,mlp]) / P_total (Eq. 16-17), E[...] under uniform top-1
routing. A MoRE layer of width m with a backbone of k channels and r petals activates on average
k + (m - k) / r channels, so it saves (m - k)(1 - 1/r) channels' parameters. Given the candidate layers
of a strategy, one backbone ratio rho for all of them is solved so that PR hits the target; a target
that needs rho outside (0, 1) on those layers is reported unreachable with the reachable range (fewer
layers save less, so dropping layers could never reach it; converting more layers, e.g.
``layers=uniform``, or more petals can).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def candidate_layers(strategy: str, num_layers: int) -> list[int]:
    """The layers a strategy converts (before the budget drops any).

    ``middle-deep``: the last two thirds of the stack (from floor(N/3)); ``early-middle``: the first two
    thirds; ``uniform``: as many layers as middle-deep, evenly spread over the whole depth; otherwise an
    explicit comma-separated list such as ``1,2,3``."""
    if strategy == "middle-deep":
        return list(range(num_layers // 3, num_layers))
    if strategy == "early-middle":
        return list(range(0, math.ceil(2 * num_layers / 3)))
    if strategy == "uniform":
        count = num_layers - num_layers // 3
        return sorted({round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count)})
    try:
        layers = sorted({int(part) for part in strategy.split(",")})
    except ValueError:
        raise ValueError(f"layers={strategy!r} must be middle-deep, uniform, early-middle or a list like 1,2,3") from None
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"layers={strategy!r}: indices must be in [0, {num_layers - 1}]")
    return layers


@dataclass(frozen=True)
class LayerShape:
    width: int             # m: MLP hidden channels
    params_per_channel: int


@dataclass(frozen=True)
class Budget:
    layers: list[int]
    backbone: dict[int, int]   # layer -> k_share
    pruning_rate: float        # PR under uniform routing, with the integer backbone sizes


def pruning_rate(shapes: dict[int, LayerShape], backbone: dict[int, int], r: int, total_params: int) -> float:
    saved = sum(s.params_per_channel * (s.width - backbone[i]) * (1 - 1 / r) for i, s in shapes.items()
                if i in backbone)
    return saved / total_params


def solve_budget(candidates: list[int], shapes: dict[int, LayerShape], r: int, total_params: int,
                 target_pr: float | None, share_ratio: float | None, tolerance: float = 0.01) -> Budget:
    """Backbone sizes (and layers) so that PR lands within ``tolerance`` of ``target_pr``; with an
    explicit ``share_ratio`` instead, k_share = max(1, floor(rho m)) on every candidate layer (§2.2)."""
    def sizes(layers: list[int], rho: float) -> dict[int, int]:
        return {i: min(shapes[i].width - r, max(1, math.floor(rho * shapes[i].width))) for i in layers}

    if target_pr is None:
        backbone = sizes(candidates, share_ratio)
        return Budget(candidates, backbone, pruning_rate(shapes, backbone, r, total_params))
    mlp = sum(shapes[i].params_per_channel * shapes[i].width for i in candidates)
    rho = 1 - target_pr * total_params / ((1 - 1 / r) * mlp)  # PR(rho) = target, solved for rho
    if 0 < rho < 1:
        backbone = sizes(candidates, rho)
        achieved = pruning_rate(shapes, backbone, r, total_params)
        if abs(achieved - target_pr) <= tolerance:
            return Budget(candidates, backbone, achieved)
    most = pruning_rate(shapes, sizes(candidates, 0.0), r, total_params)
    raise ValueError(f"target_pr={target_pr} cannot be reached with layers {candidates} and num_experts={r}: "
                     f"allowed (0, {most:.3f}] (within ±{tolerance}); convert more layers or use more experts")


def solve_naive_budget(candidates: list[int], shapes: dict[int, LayerShape], r: int, total_params: int,
                       target_pr: float, tolerance: float = 0.01) -> tuple[list[int], int, float]:
    """Table 10's naive clustering at the same budget: n_c disjoint clusters, top-1, no backbone, so a
    layer saves (1 - 1/n_c) of its MLP. Returns (layers, n_c, PR) with n_c as close to r as the target
    allows (n_c in [2, 4r]) and as many candidate layers as fit."""
    for clusters in sorted(range(2, 4 * r + 1), key=lambda n: (abs(n - r), n)):
        for count in range(len(candidates), 0, -1):
            layers = candidates[:count]
            saved = sum(shapes[i].params_per_channel * shapes[i].width for i in layers) * (1 - 1 / clusters)
            if abs(saved / total_params - target_pr) <= tolerance:
                return layers, clusters, saved / total_params
    raise ValueError(f"variant=naive cannot match PR={target_pr:.3f} within ±{tolerance} with top-1 of 2..{4 * r} "
                     f"disjoint clusters on layers {candidates}")
