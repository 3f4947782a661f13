"""Static structured pruning baseline: keep, in every MLP, the channels of highest activation-aware
importance (MoRE Eq. 7 / Wanda-style, from calibration activations), at a requested activated-parameter
ratio, with no routing and no training — the kind of baseline ToMoE and MoRE compare against.

The budget is met with MLP channels alone, the same share in every layer: keep = (active_ratio x
P_total - P_attn) / P_mlp. Pruning attention head dimensions as well is not implemented yet, so an
``active_ratio`` at or below the attention's share of the projections is rejected with the allowed
range. Layers are pruned one at a time on the outputs of the already-pruned ones (streaming), so each
importance is measured on the inputs the pruned model really produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedConfig

from moeify.calibration.data import calibration_batches
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.observers import MeanSquares
from moeify.calibration.stream import stream_layers
from moeify.methods.base import ConversionContext, Method
from moeify.methods.options import OptionError, option, require_at_most
from moeify.moe.build import static_layer
from moeify.moe.importance import channel_importance


@dataclass(frozen=True)
class StaticPruneConfig:
    active_ratio: float = option(0.5, "activated-parameter ratio to keep (APR over attention + MLP projections)",
                                 low=0.0, high=1.0, low_open=True)
    calib_samples: int = option(8, "calibration sequences", low=1)
    seq_len: int | None = option(None, "calibration sequence length (default: min(2048, model context))", low=2)

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")


def convert(ctx: ConversionContext, cfg: StaticPruneConfig) -> dict[str, Any]:
    adapter = ctx.adapter
    attn = sum(adapter.attention_params(i) for i in range(adapter.num_layers))
    mlp = sum(adapter.dense_mlp_params(i) for i in range(adapter.num_layers))
    keep_share = (cfg.active_ratio * (attn + mlp) - attn) / mlp
    if not 0 < keep_share <= 1:
        raise OptionError(f"active_ratio={cfg.active_ratio} is out of range for MLP-channel pruning of this model; "
                          f"allowed: ({attn / (attn + mlp):.4f}, 1.0]")
    seq_len = cfg.seq_len or min(2048, ctx.model.config.max_position_embeddings)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    kept = []
    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device)
    for step in tqdm(steps, total=adapter.num_layers, desc="static_prune", disable=not ctx.progress):
        weights = adapter.mlp(step.index)
        squares = MeanSquares(weights.hidden_size, weights.intermediate_size)
        with capture_inputs(adapter.mlp_module(step.index), lambda x: squares.update(x, weights.hidden(x))):
            step.run()
        count = max(1, round(keep_share * weights.intermediate_size))
        keep = channel_importance(weights, squares).argsort(descending=True)[:count]
        adapter.replace_mlp_(step.index, static_layer(weights, keep).to(weights.up.device))
        kept.append(count)
    return {"kept_channels": kept, "keep_share": keep_share,
            "calibration": {"samples": cfg.calib_samples, "seq_len": seq_len, "tokens": int(batches.numel())}}


STATIC_PRUNE = Method(
    name="static_prune",
    paper="baseline: static structured pruning of MLP channels by activation-aware importance (Wanda-style; "
          "Sun et al., 2024), as compared against in ToMoE and MoRE",
    summary="baseline: static MLP-channel pruning at a matched activated-parameter ratio, no routing",
    config_cls=StaticPruneConfig,
    convert=convert,
)
