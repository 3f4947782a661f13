"""Least-squares output projections of a converted MLP layer, given its routing.

A carved or pruned layer computes ``sum_j m_j(x) g_j(x) h_j(x) w_j``: each kept neuron's hidden value h_j
times its output column w_j, where the token's routing lets it run (m_j, the shared part always; g_j the
router's weight). The carving keeps the dense model's w_j, which were fitted for a model in which every
neuron runs; with two thirds of them off for a token, the output of the neurons that do run is no longer
the best estimate of the dense output. Given the routing on calibration tokens, the columns that minimise
the squared error to the dense MLP output are the solution of one linear system per layer (the
reconstruction step of post-training pruning, e.g. SparseGPT's, for the output projection alone):

    min_W ||H_m W - Y||^2 + lambda ||W - W_0||^2,   (H_m^T H_m + lambda I) W = H_m^T Y + lambda W_0

H_m (tokens, kept neurons) the routed hidden values, Y the dense MLP's output without its bias, W_0 the
dense columns. The ridge term pulls towards W_0, not towards 0: a neuron the calibration tokens never
route to keeps its dense column. lambda is ``damping`` times the mean of diag(H_m^T H_m), as GPTQ
dampens. The routers and the neurons' input weights stay as they are, so the routing is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moeify.arch.mlp import MlpWeights
from moeify.runtime.experts import ExpertMLP
from moeify.runtime.moe import MoeMLP

#: The share of the calibration tokens held out to measure the fit's output error before and after.
HELD_OUT_SHARE = 0.25


def _parts(layer: MoeMLP) -> list[ExpertMLP]:
    if not isinstance(layer.experts, nn.ModuleList):
        raise TypeError("refit_down_ needs disjoint experts (ExpertMLP), not overlapping ones")
    return ([layer.shared] if layer.shared is not None else []) + list(layer.experts)


def routed_hidden(layer: MoeMLP, x: Tensor) -> Tensor:
    """H_m (tokens, kept neurons): every part's hidden values in float32, shared part first, each routed
    expert's scaled by its router weight for the tokens routed to it and 0 for the others."""
    parts = _parts(layer)
    hidden = [part.neurons(x).float() for part in parts]
    if layer.router is not None:
        dispatch = layer.router(x)
        real = slice(None) if dispatch.real is None else dispatch.real
        gates = torch.zeros(x.shape[0], len(layer.experts), device=x.device)
        gates.index_put_((dispatch.token[real], dispatch.expert[real]), dispatch.weight[real].float(),
                         accumulate=True)
        first = len(parts) - len(layer.experts)
        hidden = hidden[:first] + [h * gates[:, e:e + 1] for e, h in enumerate(hidden[first:])]
    return torch.cat(hidden, dim=1)


def _relative_error(h: Tensor, w: Tensor, y: Tensor) -> float:
    return float((h @ w - y).pow(2).sum() / y.pow(2).sum())


@torch.no_grad()
def refit_down_(layer: MoeMLP, mlp: MlpWeights, x: Tensor, damping: float = 0.01) -> dict[str, Any]:
    """Replace ``layer``'s output projections by the least-squares fit to ``mlp``'s output on ``x``
    (tokens, d) (module docstring). First the fit is checked on tokens it did not see: fitted on all but
    the last ``HELD_OUT_SHARE`` of the tokens, its relative squared output error there against the dense
    columns'. Where it does not lower it (too few tokens for the layer's neurons: the fit learns the
    calibration tokens), the dense columns stay; else the fit on all tokens is written. Returns
    ``{"error_before", "error_held_out", "refitted"}`` (1.0 or 0.0, so that a mean over layers is a share)."""
    x = x.float()
    parts = _parts(layer)
    h = routed_hidden(layer, x)
    y = torch.nn.functional.linear(mlp.hidden(x).float(), mlp.down.float())  # Y without the output bias
    w0 = torch.cat([part.down.weight.float().T for part in parts])  # (kept neurons, d)
    split = int(round(x.shape[0] * (1 - HELD_OUT_SHARE)))
    seen, held = slice(0, split), slice(split, None)
    # H^T H and H^T Y of the fitted tokens; those of all tokens add the held-out ones' (one product each)
    gram, cross = h[seen].T @ h[seen], h[seen].T @ y[seen]

    def fit(gram: Tensor, cross: Tensor) -> Tensor:
        ridge = damping * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny)
        eye = torch.eye(gram.shape[0], device=gram.device)
        return torch.linalg.solve(gram + ridge * eye, cross + ridge * w0)

    report = {"error_before": _relative_error(h[held], w0, y[held]),
              "error_held_out": _relative_error(h[held], fit(gram, cross), y[held])}
    report["refitted"] = float(report["error_held_out"] < report["error_before"])
    if not report["refitted"]:
        return report
    w = fit(gram + h[held].T @ h[held], cross + h[held].T @ y[held])
    start = 0
    for part in parts:
        part.down.weight.copy_(w[start:start + part.width].T.to(part.down.weight.dtype))
        start += part.width
    return report


def mean_refit(reports: list[dict[str, float]]) -> dict[str, float]:
    """The mean over layers of ``refit_down_``'s reports (a conversion's ``details.refit_down``)."""
    return {key: sum(r[key] for r in reports) / len(reports) for key in reports[0]}
