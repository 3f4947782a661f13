"""TEAL's calibration, one decoder layer at a time: the magnitude threshold of every projection's
inputs at the target sparsity (see the package docstring)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from moeify.arch import DecoderAdapter
from moeify.calibration.data import calibration_batches
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.stream import stream_layers
from moeify.methods.base import Conversion, ConversionContext
from moeify.methods.teal.config import AttentionSparsityOptions, TealConfig
from moeify.methods.teal.memory import QUANTILE_LIMIT
from moeify.runtime.sparse_inputs import ThresholdedLinear


def magnitude_threshold(inputs: list[Tensor], sparsity: float) -> float:
    """t with P(|x| <= t) = sparsity over every entry of ``inputs`` (a strided subsample of at most
    ``QUANTILE_LIMIT`` entries when there are more)."""
    flat = torch.cat([t.detach().abs().float().reshape(-1) for t in inputs])
    flat = flat[::-(-flat.numel() // QUANTILE_LIMIT)]
    return float(torch.quantile(flat, sparsity))


def thresholded(linear: nn.Linear, sparsity: float, threshold: float) -> ThresholdedLinear:
    """``linear`` with its inputs below ``threshold`` zeroed: the same weights, shared, not copied."""
    out = ThresholdedLinear(linear.in_features, linear.out_features, linear.bias is not None, sparsity, threshold)
    out.weight, out.bias = linear.weight, linear.bias
    return out.to(device=linear.weight.device)


def _replace(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, child, module)


Projections = Callable[[DecoderAdapter, int, nn.Module], "dict[str, nn.Linear]"]  # name in the layer -> module


def every_projection(_adapter: DecoderAdapter, _i: int, layer: nn.Module) -> dict[str, nn.Linear]:
    """TEAL's: every projection of the decoder layer, attention (q/k/v or fused qkv, o) and MLP (gate/up,
    down)."""
    return {name: m for name, m in layer.named_modules() if type(m) in (nn.Linear, ThresholdedLinear)}


def thresholded_projections(_adapter: DecoderAdapter, _i: int, layer: nn.Module) -> dict[str, nn.Linear]:
    """The projections thresholded already (a refit: nothing else is touched)."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, ThresholdedLinear)}


def attention_projections(adapter: DecoderAdapter, i: int, _layer: nn.Module) -> dict[str, nn.Linear]:
    """The attention's projections alone (``attention_sparsity`` on an MoE's whole attention)."""
    projections = adapter.attention_projections(i)  # by role
    return {f"{adapter.family.attn_attr}.{attr}": projections[role] for role, attr in adapter.family.attn_projections}


def calibrate(ctx: ConversionContext, cfg: TealConfig, projections: Projections) -> dict[str, Any]:
    """The magnitude threshold of the inputs of each of ``projections`` in every decoder layer, a layer at a
    time on the outputs of the layers thresholded before it: a plain projection is replaced by its
    thresholded form at ``cfg.sparsity``, a thresholded one keeps its own sparsity and gets a new threshold.
    Returns the thresholds and the calibration (the record's details)."""
    adapter = ctx.adapter
    _, seq_len = cfg.calibration_windows(ctx.model.config)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    thresholds: list[dict[str, float]] = []
    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device)
    for step in tqdm(steps, total=adapter.num_layers, desc="teal: thresholds", disable=not ctx.progress):
        # a projection thresholded already is measured with its own threshold off, as at conversion
        linears = projections(adapter, step.index, step.layer)
        seen: dict[str, list[Tensor]] = {name: [] for name in linears}
        with ExitStack() as hooks:
            for name, m in linears.items():
                hooks.enter_context(capture_inputs(m, seen[name].append))
                if isinstance(m, ThresholdedLinear):
                    m.threshold.zero_()  # |x| > 0 keeps every input that counts
            step.run()
        layer_thresholds = {}
        by_input: dict[tuple[Any, ...], float] = {}  # q/k/v (and gate/up) read the same tensor: one quantile
        for name, linear in linears.items():
            inputs = seen.pop(name)
            sparsity = linear.sparsity if isinstance(linear, ThresholdedLinear) else cfg.sparsity
            key = (sparsity, *(t.data_ptr() for t in inputs))
            if key not in by_input:
                by_input[key] = magnitude_threshold(inputs, sparsity)
            t = by_input[key]
            if isinstance(linear, ThresholdedLinear):
                linear.threshold.fill_(t)
            else:
                _replace(step.layer, name, thresholded(linear, sparsity, t))
            layer_thresholds[name] = round(t, 6)
        thresholds.append(layer_thresholds)
    return {"thresholds": thresholds,
            "calibration": {"samples": cfg.calib_samples, "seq_len": seq_len, "tokens": int(batches.numel())}}


def convert(ctx: ConversionContext, cfg: TealConfig) -> Conversion:
    return Conversion(ctx.model, calibrate(ctx, cfg, every_projection))


def refit(ctx: ConversionContext, cfg: TealConfig) -> dict[str, Any]:
    """The thresholds of a model whose weights a recovery moved, calibrated again on the conversion's windows:
    the inputs' magnitudes shift with the weights, so the old cut-offs no longer zero ``sparsity`` of them.
    Returns the new thresholds and the calibration (the record's ``recovery.refit``)."""
    return calibrate(ctx, cfg, thresholded_projections)


def threshold_attention(ctx: ConversionContext, options: AttentionSparsityOptions) -> dict[str, Any]:
    """TEAL's thresholds on the attention projections of a converted model (``attention_sparsity``), in place;
    the record's entry."""
    return calibrate(ctx, options.calibration(), attention_projections)
