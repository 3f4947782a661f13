"""Router distillation for export (``--approximate``): fit a linear router to a non-linear router's decisions.

Standard MoE formats compute router scores ``x @ W.T``; CMoE's router scores are SwiGLU hidden values
of representative neurons, which no linear map reproduces. ``distill_routers`` records, on calibration
text, each such layer's input x and the k experts its router chose, and fits W by multinomial logistic
regression towards the chosen set (each chosen expert against the unchosen ones: ``set_loss``; full-batch
Adam, ``steps`` steps) from the experts' mean directions. The result is an approximation, labelled so
everywhere: the export record carries the decision agreement (the chosen set reproduced exactly) on the
calibration tokens and on held-out tokens, and the caller measures the perplexity change.

Top-k with k > 1 and unit weights (CMoE's S2A2E16) has no format: engines weigh the k experts by router
scores. The closest is qwen2_moe's renormalised softmax (``norm_topk_prob``): weights p_i / sum of the
chosen p, times k folded into the experts (``Routing.expert_scale``). W is scaled so that the scores on
the calibration tokens stay within ``SCORE_SPAN`` of 0: the softmax then keeps their order while the
renormalised weights are k p_i / sum p = 1 within about ``SCORE_SPAN`` (measured, per layer, on the
held-out tokens: ``max_weight_dev_from_1``).

Inputs are captured from the source model (each layer sees the source's own earlier layers), so the
fit targets exactly the decisions the original router makes; errors can compound across layers in the
exported model, which the perplexity measures.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moeify.calibration.hooks import capture_inputs
from moeify.export.hf_parts import Routing

LEARNING_RATE = 0.05  # Adam, on inputs scaled to unit mean square
SCORE_SPAN = 1e-3  # largest |score| of a top-k > 1 router on calibration tokens: weights 1 within ~1e-3


@dataclass(frozen=True)
class Distillation:
    """Fitted routers by layer path, and per layer the agreement with the original router's choices."""

    routings: dict[str, Routing]
    layers: list[dict]
    steps: int

    def mean_agreement(self, key: str) -> float:
        return sum(layer[key] for layer in self.layers) / len(self.layers)


@torch.no_grad()
def router_decisions(model: PreTrainedModel, paths: list[str], windows: list[Tensor]
                     ) -> dict[str, tuple[Tensor, Tensor, float]]:
    """(x (tokens, d) in float32, chosen experts (tokens, k), largest |weight - 1| of the original routing)
    for each MoE layer in ``paths``: the distilled router weighs its experts 1, the original may not."""
    inputs: dict[str, list[Tensor]] = {p: [] for p in paths}
    device = next(model.parameters()).device
    with ExitStack() as stack:
        for path in paths:
            stack.enter_context(capture_inputs(model.get_submodule(path),
                                               lambda x, path=path: inputs[path].append(x.reshape(-1, x.shape[-1]))))
        for window in windows:
            model(input_ids=window[None].to(device), use_cache=False)
    out = {}
    for path in paths:
        x = torch.cat(inputs[path])
        dispatch = model.get_submodule(path).router(x)  # a top-k router: pair `slot` of (tokens, k)
        chosen = torch.empty(x.shape[0] * dispatch.top_k, dtype=torch.long, device=x.device)
        chosen[dispatch.slot] = dispatch.expert
        out[path] = (x.float().cpu(), chosen.view(x.shape[0], -1).cpu(),
                     float((dispatch.weight.float() - 1).abs().max()))
    return out


def set_loss(scores: Tensor, chosen: Tensor) -> Tensor:
    """Mean over tokens and chosen experts i of -log(e^s_i / (e^s_i + sum of e^s_j over the experts not
    chosen)): each chosen expert against the unchosen ones only, so the loss is the set's boundary and not
    an order within it; for k = 1 it is the cross-entropy."""
    others = scores.scatter(1, chosen, float("-inf")).logsumexp(dim=-1, keepdim=True)
    return nn.functional.softplus(others - scores.gather(1, chosen)).mean()


def fit_linear_router(x: Tensor, chosen: Tensor, num_experts: int, steps: int, seed: int = 0) -> Tensor:
    """W (experts, d) whose top-k of x.W reproduces the chosen sets ``chosen`` (tokens, k) as often as it
    can (``set_loss``), from each expert's mean input direction."""
    scale = x.pow(2).mean().sqrt().clamp_min(1e-12)
    xs = x / scale  # (tokens, d), unit mean square: one learning rate fits every model width
    init = torch.zeros(num_experts, x.shape[1]).index_add_(0, chosen.reshape(-1),
                                                           xs.repeat_interleave(chosen.shape[1], dim=0))
    init = init / init.norm(dim=1, keepdim=True).clamp_min(1e-12)
    torch.manual_seed(seed)
    weight = nn.Parameter(init)
    optimizer = torch.optim.Adam([weight], lr=LEARNING_RATE)
    for _ in range(steps):
        optimizer.zero_grad()
        set_loss(xs @ weight.T, chosen).backward()
        optimizer.step()
    return weight.detach() / scale  # scores x @ (W / scale).T = (x / scale) @ W.T


def agreement(weight: Tensor, x: Tensor, chosen: Tensor) -> float:
    """Share of tokens where the linear router picks exactly the original router's set of experts."""
    picked = (x @ weight.T).topk(chosen.shape[1], dim=-1).indices.sort(dim=-1).values
    return float((picked == chosen.sort(dim=-1).values).all(dim=-1).float().mean())


def renormalised_weight_deviation(weight: Tensor, x: Tensor, k: int) -> float:
    """Largest |k p_i / sum of the chosen p - 1| over the tokens ``x``: how far qwen2_moe's renormalised
    weights (times k) of router ``weight`` are from CMoE's unit weights."""
    p = torch.softmax(x @ weight.T, dim=-1).topk(k, dim=-1).values
    return float((k * p / p.sum(dim=-1, keepdim=True) - 1).abs().max())


def distilled_routing(weight: Tensor, x: Tensor, k: int) -> Routing:
    """Unit top-1 as it is; unit top-k as renormalised weights of scores scaled into ``SCORE_SPAN``."""
    if k == 1:
        return Routing(weight, 1, "unit", approximate=True)
    span = float((x @ weight.T).abs().max())
    return Routing(weight * (SCORE_SPAN / span if span > 0 else 1.0), k, "renormalised", approximate=True,
                   expert_scale=float(k))


def distill_routers(model: PreTrainedModel, paths: list[str], steps: int, calib: list[Tensor],
                    held_out: list[Tensor], *, seed: int = 0) -> Distillation:
    """Fit a linear top-k router for each layer in ``paths`` on the token windows ``calib``; agreement on
    both."""
    fit = router_decisions(model, paths, calib)
    test = router_decisions(model, paths, held_out)
    routings, layers = {}, []
    for path in paths:
        router = model.get_submodule(path).router
        x, chosen, weight_dev = fit[path]
        k = chosen.shape[1]
        routing = distilled_routing(fit_linear_router(x, chosen, router.num_experts, steps, seed), x, k)
        routings[path] = routing
        layers.append({"path": path, "top_k": k, "calib_tokens": x.shape[0], "held_out_tokens": test[path][0].shape[0],
                       "calib_agreement": agreement(routing.weight, x, chosen),
                       "held_out_agreement": agreement(routing.weight, *test[path][:2]),
                       "original_weight_max_dev_from_1": max(weight_dev, test[path][2]),
                       "max_weight_dev_from_1": 0.0 if k == 1 else
                       renormalised_weight_deviation(routing.weight, test[path][0], k)})
    return Distillation(routings, layers, steps)
