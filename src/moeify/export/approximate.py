"""``moeify export --approximate``: the closest form a standard format computes of each part of a converted
model that no format computes exactly, chosen on calibration text and measured on held-out text.

* Non-linear top-k routers (CMoE's representative-neuron scores): linear routers fitted to their decisions
  (``hf_distill``; agreement: the chosen set reproduced exactly).
* DSMoE's threshold router (Eq. 7-8: expert i runs when g_i = sigma(x Y)_i >= tau, weighted
  g_i gate_scale n / |A|, so |A| varies per token): the same gates at one fixed k (formats fix k for all
  layers), weighted g_i gate_scale n / k (``"sigmoid"`` weighting: glm4_moe without ``norm_topk_prob``).
  The top-k gates are the top-k scores x Y, so nothing is fitted; a token's set is reproduced exactly
  when its |A| = k (agreement), so k is the most common |A| >= 1 over every layer's calibration tokens.
  The mean |A| would keep the conversion's compute, but a layer whose gates are mostly off drags it
  below what every other layer runs: in a 10-step DSMoE of SmolLM2 (one layer with almost every gate off,
  the others running most of their experts) k at the mean reproduces almost no held-out token's set and
  about doubles the perplexity, where k at the most common count reproduces most of them and does not
  raise it (``benchmarks/serve_vllm.py``).
* ToMoE's per-token value/output head dimensions (Eq. 4-5): the K dimensions the most calibration tokens
  keep, the same K for every token (so the same activated parameters), zero-padded like static pruning;
  agreement: the mean share of a held-out token's own K dimensions in that static set.
* TEAL's input thresholds: dropped (the dense weights); no serving engine computes activation sparsity.
  Agreement: the share of projection inputs the thresholds keep on held-out text (the rest, zeroed by TEAL,
  are the difference).
* Dense layers (``--dense-layers``; exact layers too, to serve faster): routed layers as dense MLPs of every
  neuron they hold (``hf_parts.dense_form``), named or chosen as the layers whose dense form makes the
  format's layout cheapest (``auto``). A ToMoE of SmolLM2 trained 250 steps keeps nearly every neuron per
  token in layer 0 and under half in the others; qwen2_moe pads every layer to layer 0's shared part (more
  neurons per token than dense); with layer 0 dense, every other layer runs under half the dense width
  (``benchmarks/serve_vllm.py``, row ``tomoe-250-dense``).
  Agreement: the mean cosine similarity of the layer's output and its dense form's on held-out tokens.

Every part is chosen on the calibration windows from the source model (each layer sees the source's own
earlier layers); the caller measures the perplexity of source and export on held-out text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moeify.arch import DecoderAdapter
from moeify.calibration.data import TextSource, token_stream
from moeify.calibration.hooks import observing
from moeify.export.hf_distill import distill_routers
from moeify.export.hf_export import EXPORTERS
from moeify.export.hf_parts import (
    Approximation,
    GatedMlp,
    NotRepresentable,
    Routing,
    dense_form,
    linear_routing,
)
from moeify.moe.accounting import tracking_routing
from moeify.runtime.attention import PrunedAttention
from moeify.runtime.moe import MoeMLP
from moeify.runtime.sparse_inputs import ThresholdedLinear

MAX_TOKENS = 16384  # per text: fitted routers hold every distilled layer's inputs (tokens x d floats)


def windows(source: TextSource, tokenizer: Any, seq_len: int, max_tokens: int = MAX_TOKENS) -> list[Tensor]:
    """The first ``max_tokens`` tokens of ``source`` in windows of ``seq_len``."""
    stream = token_stream(source, tokenizer)[:max_tokens].long()
    return [w for w in stream.split(seq_len) if len(w) >= 2]


@torch.no_grad()
def _run(model: PreTrainedModel, windows_: list[Tensor], observers: dict[nn.Module, Callable[[Tensor, Any], None]]
         ) -> None:
    device = next(model.parameters()).device
    with observing(observers):
        for window in windows_:
            model(input_ids=window[None].to(device), use_cache=False)


def _non_linear_routers(model: PreTrainedModel) -> dict[str, nn.Module]:
    """Routers (by MoE layer path) that no format computes but a close linear top-k router approximates."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MoeMLP) and module.router is not None:
            try:
                linear_routing(module.router)
            except NotRepresentable as error:
                if error.approximable:
                    out[name] = module.router
    return out


def threshold_routings(routers: dict[str, nn.Module], model: PreTrainedModel, calib: list[Tensor],
                       held_out: list[Tensor]) -> tuple[dict[str, Routing], dict[str, Any]]:
    """Routers that run a token-dependent number of experts (DSMoE's) as their ``fixed_k_form`` at one k,
    the most common count on ``calib`` (see the module docstring), and the record."""
    def counting(store: dict[str, list[Tensor]]) -> dict[nn.Module, Callable[[Tensor, Any], None]]:
        return {r: lambda x, dispatch, p=p: store[p].append(  # experts per token: |A|
            torch.bincount(dispatch.chosen().token, minlength=x.reshape(-1, x.shape[-1]).shape[0]).cpu())
            for p, r in routers.items()}

    fit: dict[str, list[Tensor]] = {p: [] for p in routers}
    test: dict[str, list[Tensor]] = {p: [] for p in routers}
    _run(model, calib, counting(fit))
    _run(model, held_out, counting(test))
    fit_counts = {p: torch.cat(c) for p, c in fit.items()}
    n = next(iter(routers.values())).num_experts
    histogram = torch.bincount(torch.cat(list(fit_counts.values())).long(), minlength=n + 1)  # over every layer
    k = most_common_count(histogram)
    routings, layers = {}, []
    for path, router in routers.items():
        held = torch.cat(test[path])
        form = router.fixed_k_form(k)
        routings[path] = Routing(form.weight, form.top_k, form.weighting, approximate=True,
                                 expert_scale=form.expert_scale)
        layers.append({"path": path, "calib_mean_experts": float(fit_counts[path].float().mean()),
                       "held_out_mean_experts": float(held.float().mean()),
                       "held_out_agreement": float((held == k).float().mean())})
    return routings, {"top_k": k, "held_out_agreement": sum(x["held_out_agreement"] for x in layers) / len(layers),
                      "calib_count_shares": (histogram / histogram.sum()).tolist(), "layers": layers}


def most_common_count(histogram: Tensor) -> int:
    """The most common number of experts per token, at least 1, in ``histogram`` (tokens by experts per token,
    from 0 to n): the fixed k that reproduces the most tokens' expert sets; the smallest such k on a tie."""
    return 1 + int(histogram[1:].argmax())


def static_attention_dims(attentions: dict[str, PrunedAttention], model: PreTrainedModel, calib: list[Tensor],
                          held_out: list[Tensor]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Each per-token attention's K value/output dimensions most kept on ``calib`` (ascending), and the
    record with each layer's held-out overlap."""
    counts = {p: torch.zeros(a.head_dim) for p, a in attentions.items()}
    _run(model, calib, {a.router: lambda _x, chosen, p=p: counts[p].add_(
        torch.bincount(chosen.reshape(-1).cpu(), minlength=len(counts[p])).float()) for p, a in attentions.items()})
    dims = {p: counts[p].topk(a.router.top_k).indices.sort().values for p, a in attentions.items()}
    overlap: dict[str, list[float]] = {p: [] for p in attentions}
    _run(model, held_out, {a.router: lambda _x, chosen, p=p: overlap[p].append(
        float(torch.isin(chosen.cpu(), dims[p]).float().mean())) for p, a in attentions.items()})
    layers = [{"path": p, "kept_dims": a.router.top_k, "head_dim": a.head_dim,
               "held_out_agreement": sum(overlap[p]) / max(1, len(overlap[p]))} for p, a in attentions.items()]
    return dims, {"held_out_agreement": sum(x["held_out_agreement"] for x in layers) / len(layers), "layers": layers}


def kept_inputs(projections: list[ThresholdedLinear], model: PreTrainedModel, held_out: list[Tensor]) -> float:
    """The share of thresholded projections' inputs that the thresholds keep on ``held_out``."""
    with tracking_routing(model):
        _run(model, held_out, {})
    return sum(m.stats_kept for m in projections) / max(1, sum(m.stats_inputs for m in projections))


def dense_modules(model: PreTrainedModel, layers: list[int]) -> dict[int, tuple[MoeMLP, GatedMlp]]:
    """The MoE layers ``layers`` names with their dense forms (``ValueError`` naming one that has none)."""
    adapter = DecoderAdapter(model)
    out = {}
    for i in layers:
        if not 0 <= i < adapter.num_layers:
            raise ValueError(f"--dense-layers: layer {i} is not in [0, {adapter.num_layers - 1}]")
        module = adapter.mlp_module(i)
        if not isinstance(module, MoeMLP) or module.router is None:
            raise ValueError(f"--dense-layers: layer {i} routes nothing (it is dense already)")
        try:
            out[i] = module, dense_form(module)
        except NotRepresentable as error:
            raise ValueError(f"--dense-layers: layer {i}: {error.reason}") from None
    return out


def dense_agreement(layers_: dict[int, tuple[MoeMLP, GatedMlp]], model: PreTrainedModel, held_out: list[Tensor]
                    ) -> dict[str, Any]:
    """Each dense-form layer's mean cosine similarity to the routed layer's output on ``held_out`` tokens."""
    cosines: dict[int, list[Tensor]] = {i: [] for i in layers_}
    _run(model, held_out, {m: lambda x, y, i=i, form=form: cosines[i].append(nn.functional.cosine_similarity(
        form(x.float()).flatten(0, -2), y.float().flatten(0, -2), dim=-1).cpu()) for i, (m, form) in layers_.items()})
    layers = [{"layer": i, "dense_width": layers_[i][1].width, "held_out_agreement": float(torch.cat(c).mean())}
              for i, c in cosines.items()]
    return {"held_out_agreement": sum(x["held_out_agreement"] for x in layers) / len(layers), "layers": layers}


def approximate(model: PreTrainedModel, tokenizer: Any, calib: TextSource, held_out: TextSource, *,
                steps: int, seq_len: int, seed: int = 0, dense_layers: list[int] | str = (),
                fmt: str | None = None) -> tuple[Approximation, dict[str, Any]]:
    """The ``Approximation`` of every part of ``model`` no format computes, and per part what it is and its
    held-out agreement. ``steps``: optimiser steps of fitted routers. ``dense_layers``: layer indices to
    export dense, or ``"auto"``: the cheapest for format ``fmt`` (``HfExporter.cheapest_dense_layers``).
    ``ValueError`` when nothing needs it."""
    routers = _non_linear_routers(model)
    thresholded = {p: r for p, r in routers.items() if hasattr(r, "fixed_k_form")}
    fitted = [p for p in routers if p not in thresholded]
    attentions = {n: m for n, m in model.named_modules() if isinstance(m, PrunedAttention) and m.router is not None}
    projections = [m for m in model.modules() if isinstance(m, ThresholdedLinear)]
    named_dense = dense_modules(model, list(dense_layers)) if dense_layers != "auto" else {}
    if not (routers or attentions or projections or dense_layers):
        raise ValueError("--approximate applies to parts no format computes (non-linear or threshold routers, "
                         "per-token attention dimensions, input thresholds); this model has none: its export "
                         "is exact without it")
    calib_windows, held_windows = windows(calib, tokenizer, seq_len), windows(held_out, tokenizer, seq_len)
    routings, dims, parts = {}, {}, {}
    if fitted:
        if steps < 1:
            raise ValueError(f"distill steps={steps} must be >= 1")
        distillation = distill_routers(model, fitted, steps, calib_windows, held_windows, seed=seed)
        routings.update(distillation.routings)
        parts["fitted_routers"] = {
            "what": "linear routers fitted to the original routers' top-k decisions", "steps": steps,
            "calib_agreement": distillation.mean_agreement("calib_agreement"),
            "held_out_agreement": distillation.mean_agreement("held_out_agreement"), "layers": distillation.layers}
    if thresholded:
        topk, record = threshold_routings(thresholded, model, calib_windows, held_windows)
        routings.update(topk)
        parts["threshold_routers"] = {"what": f"the gates above tau replaced by the top-{record['top_k']} gates "
                                              "(the most common count on calibration text)", **record}
    if attentions:
        dims, record = static_attention_dims(attentions, model, calib_windows, held_windows)
        parts["attention"] = {"what": "per-token value/output head dimensions replaced by the ones most "
                                      "calibration tokens keep (the same count)", **record}
    if projections:
        parts["input_thresholds"] = {"what": "activation thresholds dropped: the dense projections",
                                     "held_out_agreement": kept_inputs(projections, model, held_windows)}
    approximation = Approximation(routings, dims, drop_thresholds=bool(projections))
    if dense_layers == "auto":
        chosen = EXPORTERS[fmt].cheapest_dense_layers(model, approximation)
        if not (chosen or approximation):
            raise ValueError(f"--dense-layers auto: no routed layer's dense form makes the {fmt} layout run fewer "
                             "neurons per token; its export is exact and as cheap without it")
        named_dense = dense_modules(model, chosen)
    if named_dense:
        named = f"layer{'s' if len(named_dense) > 1 else ''} {', '.join(map(str, named_dense))}"
        parts["dense_layers"] = {"what": f"{named} dense: every neuron held, for every token",
                                 **dense_agreement(named_dense, model, held_windows)}
        approximation = replace(approximation, dense_layers=frozenset(named_dense))
    return approximation, parts
