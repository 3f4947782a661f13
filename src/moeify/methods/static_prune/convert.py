"""The static-pruning baseline's conversion, one decoder layer at a time (see the package docstring)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from moeify.arch import DecoderAdapter
from moeify.arch.mlp import MlpWeights
from moeify.calibration.data import calibration_batches, token_stream
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.observers import MeanSquares
from moeify.calibration.stream import stream_layers
from moeify.methods.base import Conversion, ConversionContext
from moeify.methods.static_prune.config import StaticPruneConfig
from moeify.moe.accounting import attention_share, mlp_share_for_apr
from moeify.moe.attention.head_dim import head_dim_support, pruned_attention
from moeify.moe.attention.importance import observe_head_dims, static_head_dims
from moeify.moe.experts.build import static_layer
from moeify.moe.experts.importance import channel_importance
from moeify.moe.experts.refit import mean_refit, refit_down_
from moeify.options import OptionError
from moeify.training.lora import lora_finetune


def _attention_blocker(adapter: DecoderAdapter, cfg: StaticPruneConfig) -> str | None:
    """Why the attention is left dense (None: it is pruned)."""
    if cfg.attention == "off":
        return "attention=off"
    reasons = (head_dim_support(adapter, i) for i in range(adapter.num_layers))
    return next((reason for reason in reasons if reason is not None), None)


def _mlp_only_share(adapter: DecoderAdapter, active_ratio: float) -> float:
    """The MLP share that meets ``active_ratio`` with the attention dense; rejects unreachable ratios."""
    keep_share = mlp_share_for_apr(active_ratio, adapter)
    if not 0 < keep_share <= 1:
        raise OptionError(f"active_ratio={active_ratio} is out of range for MLP-channel pruning of this model; "
                          f"allowed: ({attention_share(adapter):.4f}, 1.0]")
    return keep_share


def _channels_for(weights: MlpWeights, mlp_budget: float) -> int:
    """The channel count whose active MLP parameters (channels + the output bias) come closest to
    ``mlp_budget``, between 1 and all."""
    bias = 0 if weights.down_bias is None else weights.down_bias.numel()
    count = round((mlp_budget - bias) / weights.params_per_neuron())
    return min(weights.intermediate_size, max(1, count))


def convert(ctx: ConversionContext, cfg: StaticPruneConfig) -> Conversion:
    adapter = ctx.adapter
    blocker = _attention_blocker(adapter, cfg)
    keep_share = _mlp_only_share(adapter, cfg.active_ratio) if blocker else cfg.active_ratio
    _, seq_len = cfg.calibration_windows(ctx.model.config)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    kept, qk_kept, vo_kept = [], [], []
    refits: list[dict[str, float]] = []
    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device)
    for step in tqdm(steps, total=adapter.num_layers, desc="static_prune", disable=not ctx.progress):
        i = step.index
        weights = adapter.mlp(i)
        attn = adapter.attention_module(i)
        projections = None if blocker else adapter.attention_projections(i)  # q/k/v/o by role
        squares = MeanSquares(weights.hidden_size, weights.intermediate_size)
        inputs: list[Tensor] = []

        def observe(x: Tensor) -> None:
            squares.update(x, weights.hidden(x))
            if cfg.refit_down:
                inputs.append(x.reshape(-1, x.shape[-1]))

        with (capture_inputs(adapter.mlp_module(i), observe),
              nullcontext() if blocker else observe_head_dims(projections, attn.head_dim) as head_squares):
            step.run()
        if blocker:
            count = max(1, round(keep_share * weights.intermediate_size))
        else:
            qk_index, vo_index = static_head_dims(head_squares, projections["o"].weight, cfg.active_ratio)
            pruned = pruned_attention(adapter, i, qk_index, vo_index=vo_index)
            # The layer's budget r x (P_attn + P_mlp), less what the pruned attention activates.
            budget = cfg.active_ratio * (adapter.attention_params(i) + weights.num_params) - pruned.active_params()
            count = _channels_for(weights, budget)
            adapter.replace_attention_(i, pruned)
            qk_kept.append(len(qk_index))
            vo_kept.append(len(vo_index))
        keep = channel_importance(weights, squares).argsort(descending=True)[:count]
        layer = static_layer(weights, keep).to(weights.up.device)
        if cfg.refit_down:
            refits.append(refit_down_(layer, weights, torch.cat(inputs)))
        adapter.replace_mlp_(i, layer)
        kept.append(count)
    details: dict[str, Any] = {"attention_pruned": blocker is None, "attention_reason": blocker,
                               "kept_channels": kept, "keep_share": keep_share}
    if blocker is None:
        details.update(kept_qk_dims=qk_kept, kept_vo_dims=vo_kept)
    if refits:
        details["refit_down"] = mean_refit(refits)
    details["calibration"] = {"samples": cfg.calib_samples, "seq_len": seq_len, "tokens": int(batches.numel())}
    model = ctx.model
    if cfg.finetunes:
        model, log = lora_finetune(model, cfg, token_stream(ctx.calib, ctx.tokenizer), cfg.plan(seq_len),
                                   seed=ctx.seed + 1, device=ctx.device, progress=ctx.progress,
                                   desc="static_prune: LoRA fine-tuning")
        details["finetune"] = log.summary()
    return Conversion(model, details)
