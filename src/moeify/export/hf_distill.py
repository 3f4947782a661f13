"""Router distillation for export: fit a linear router to a non-linear router's decisions.

Standard MoE formats compute router scores ``x @ W.T``; CMoE's router scores are SwiGLU hidden values
of representative neurons, which no linear map reproduces. ``distill_routers`` records, on calibration
text, each such layer's input x and the expert its router chose (top-1), and fits W by multinomial
logistic regression (full-batch Adam, ``steps`` steps) from the experts' mean directions. The result is
an approximation, labelled so everywhere: the export record carries the decision agreement on the
calibration tokens and on held-out tokens, and the caller measures the perplexity change.

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

from moeify.calibration.data import TextSource, token_stream
from moeify.calibration.hooks import capture_inputs
from moeify.export.hf_parts import Routing

MAX_TOKENS = 16384  # per text: inputs of every distilled layer are held in memory (tokens x d floats)
LEARNING_RATE = 0.05  # Adam, on inputs scaled to unit mean square


@dataclass(frozen=True)
class Distillation:
    """Fitted routers by layer path, and per layer the agreement with the original router's choices."""

    routings: dict[str, Routing]
    layers: list[dict]
    steps: int

    def mean_agreement(self, key: str) -> float:
        return sum(layer[key] for layer in self.layers) / len(self.layers)


def _windows(source: TextSource, tokenizer, seq_len: int, max_tokens: int) -> list[Tensor]:
    stream = token_stream(source, tokenizer)[:max_tokens].long()
    return [w for w in stream.split(seq_len) if len(w) >= 2]


@torch.no_grad()
def router_decisions(model: PreTrainedModel, paths: list[str], windows: list[Tensor]
                     ) -> dict[str, tuple[Tensor, Tensor, float]]:
    """(x (tokens, d) in float32, chosen expert (tokens,), largest |weight - 1| of the original routing)
    for each MoE layer in ``paths``: the distilled router weighs its expert 1, the original may not."""
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
        dispatch = model.get_submodule(path).router(x)  # top-1: each token appears once
        chosen = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        chosen[dispatch.token] = dispatch.expert
        out[path] = (x.float().cpu(), chosen.cpu(), float((dispatch.weight.float() - 1).abs().max()))
    return out


def fit_linear_router(x: Tensor, chosen: Tensor, num_experts: int, steps: int, seed: int = 0) -> Tensor:
    """W (experts, d) whose argmax_e x.W_e reproduces ``chosen`` as often as it can: cross-entropy of
    the scores against the choices, from each expert's mean input direction."""
    scale = x.pow(2).mean().sqrt().clamp_min(1e-12)
    xs = x / scale  # (tokens, d), unit mean square: one learning rate fits every model width
    init = torch.zeros(num_experts, x.shape[1]).index_add_(0, chosen, xs)
    init = init / init.norm(dim=1, keepdim=True).clamp_min(1e-12)
    torch.manual_seed(seed)
    weight = nn.Parameter(init)
    optimizer = torch.optim.Adam([weight], lr=LEARNING_RATE)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(xs @ weight.T, chosen).backward()
        optimizer.step()
    return weight.detach() / scale  # scores x @ (W / scale).T = (x / scale) @ W.T


def agreement(weight: Tensor, x: Tensor, chosen: Tensor) -> float:
    """Share of tokens where the linear router picks the original router's expert."""
    return float(((x @ weight.T).argmax(dim=-1) == chosen).float().mean())


def distill_routers(model: PreTrainedModel, tokenizer, paths: list[str], steps: int, calib: TextSource,
                    held_out: TextSource, *, seq_len: int, max_tokens: int = MAX_TOKENS, seed: int = 0) -> Distillation:
    """Fit a linear top-1 router for each layer in ``paths`` on ``calib``; agreement on both texts."""
    if steps < 1:
        raise ValueError(f"distill steps={steps} must be >= 1")
    fit = router_decisions(model, paths, _windows(calib, tokenizer, seq_len, max_tokens))
    test = router_decisions(model, paths, _windows(held_out, tokenizer, seq_len, max_tokens))
    routings, layers = {}, []
    for path in paths:
        router = model.get_submodule(path).router
        x, chosen, weight_dev = fit[path]
        weight = fit_linear_router(x, chosen, router.num_experts, steps, seed)
        routings[path] = Routing(weight, 1, "unit", approximate=True)
        layers.append({"path": path, "calib_tokens": x.shape[0], "held_out_tokens": test[path][0].shape[0],
                       "calib_agreement": agreement(weight, x, chosen),
                       "held_out_agreement": agreement(weight, *test[path][:2]),
                       "original_weight_max_dev_from_1": max(weight_dev, test[path][2])})
    return Distillation(routings, layers, steps)
