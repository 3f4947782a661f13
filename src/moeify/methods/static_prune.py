"""Static structured pruning baseline: keep, in every layer, the attention head dimensions and the MLP
channels of highest activation-aware importance (from calibration activations), at a requested
activated-parameter ratio, with no routing and no training — the kind of baseline ToMoE and MoRE
compare against.

Choices:
- One kept share r = ``active_ratio`` for every projection type, so APR = r. Per layer, query/key keep
  round(r x hd/2) RoPE pairs (dimensions i and i + hd/2 together, ToMoE Appendix A.2) and value/output
  round(r x hd) dimensions, the same in every head (``moe.attention_importance`` has the scores); the
  MLP keeps the channels that bring the layer's active projections closest to r x its dense ones,
  about round(r x intermediate), absorbing the attention's rounding to whole pairs, so that the APR
  stays within one MLP channel of r per layer even with tiny heads (head_dim 8-16). At least one pair,
  one value dimension and one channel are kept, so a tiny r can end above its budget; the record's APR
  is counted, not assumed. ``keep_share`` in the details is then r.
- Measured on stories260K (head_dim 8) at APR 0.5, embedded eval slice: perplexity 197 with attention
  pruned against 109 with ``attention=off`` (dense 3.95): halving a head this narrow costs more than the
  MLP channels it spares, so compare both on a real model before choosing.
- MLP channels are scored as in MoRE Eq. 7 / Wanda (``moe.importance``).
- Layers are pruned one at a time on the outputs of the already-pruned ones (streaming), so each
  importance is measured on the inputs the pruned model really produces. Within a layer, attention and
  MLP statistics come from the same pass, through the dense layer.
- Where the attention's head dimension cannot be pruned (``moe.head_dim.head_dim_support``: Qwen3's
  q/k norms, Phi-3's fused qkv, GPT-NeoX/Phi partial rotary and fused projections), or with
  ``attention=off`` (the ablation), the budget is met with MLP channels alone, the same share in every
  layer: keep = (r x P_total - P_attn) / P_mlp, and r at or below the attention's share is rejected with
  the allowed range. The returned details say which was done (``attention_pruned``) and why.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

from tqdm.auto import tqdm
from transformers import PreTrainedConfig

from moeify.arch import DecoderAdapter
from moeify.arch.mlp import MlpWeights
from moeify.calibration.data import calibration_batches
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.observers import MeanSquares
from moeify.calibration.stream import stream_layers
from moeify.methods.base import ConversionContext, Method
from moeify.methods.options import OptionError, option, require_at_most
from moeify.moe.attention_importance import observe_head_dims, static_head_dims
from moeify.moe.build import static_layer
from moeify.moe.head_dim import head_dim_support, pruned_attention
from moeify.moe.importance import channel_importance


@dataclass(frozen=True)
class StaticPruneConfig:
    active_ratio: float = option(0.5, "activated-parameter ratio to keep (APR over attention + MLP projections)",
                                 low=0.0, high=1.0, low_open=True)
    attention: Literal["on", "off"] = option("on", "also prune attention head dimensions (off = MLP channels "
                                                   "only; unsupported attention falls back to off)")
    calib_samples: int = option(8, "calibration sequences", low=1)
    seq_len: int | None = option(None, "calibration sequence length (default: min(2048, model context))", low=2)

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")


def _attention_blocker(adapter: DecoderAdapter, cfg: StaticPruneConfig) -> str | None:
    """Why the attention is left dense (None: it is pruned)."""
    if cfg.attention == "off":
        return "attention=off"
    reasons = (head_dim_support(adapter.attention_module(i)) for i in range(adapter.num_layers))
    return next((reason for reason in reasons if reason is not None), None)


def _mlp_only_share(adapter: DecoderAdapter, active_ratio: float) -> float:
    """The MLP share that meets ``active_ratio`` with the attention dense; rejects unreachable ratios."""
    attn = sum(adapter.attention_params(i) for i in range(adapter.num_layers))
    mlp = sum(adapter.dense_mlp_params(i) for i in range(adapter.num_layers))
    keep_share = (active_ratio * (attn + mlp) - attn) / mlp
    if not 0 < keep_share <= 1:
        raise OptionError(f"active_ratio={active_ratio} is out of range for MLP-channel pruning of this model; "
                          f"allowed: ({attn / (attn + mlp):.4f}, 1.0]")
    return keep_share


def _channels_for(weights: MlpWeights, mlp_budget: float) -> int:
    """The channel count whose active MLP parameters (channels + the output bias) come closest to
    ``mlp_budget``, between 1 and all."""
    bias = 0 if weights.down_bias is None else weights.down_bias.numel()
    count = round((mlp_budget - bias) / weights.params_per_neuron())
    return min(weights.intermediate_size, max(1, count))


def convert(ctx: ConversionContext, cfg: StaticPruneConfig) -> dict[str, Any]:
    adapter = ctx.adapter
    blocker = _attention_blocker(adapter, cfg)
    keep_share = _mlp_only_share(adapter, cfg.active_ratio) if blocker else cfg.active_ratio
    seq_len = cfg.seq_len or min(2048, ctx.model.config.max_position_embeddings)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    kept, qk_kept, vo_kept = [], [], []
    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device)
    for step in tqdm(steps, total=adapter.num_layers, desc="static_prune", disable=not ctx.progress):
        i = step.index
        weights = adapter.mlp(i)
        attn = adapter.attention_module(i)
        projections = None if blocker else adapter.attention_projections(i)  # q/k/v/o by role
        squares = MeanSquares(weights.hidden_size, weights.intermediate_size)
        with (capture_inputs(adapter.mlp_module(i), lambda x: squares.update(x, weights.hidden(x))),
              nullcontext() if blocker else observe_head_dims(projections, attn.head_dim) as head_squares):
            step.run()
        if blocker:
            count = max(1, round(keep_share * weights.intermediate_size))
        else:
            qk_index, vo_index = static_head_dims(head_squares, projections["o"].weight, cfg.active_ratio)
            pruned = pruned_attention(attn, qk_index, vo_index=vo_index)
            # The layer's budget r x (P_attn + P_mlp), less what the pruned attention activates.
            budget = cfg.active_ratio * (adapter.attention_params(i) + weights.num_params) - pruned.active_params()
            count = _channels_for(weights, budget)
            adapter.replace_attention_(i, pruned)
            qk_kept.append(len(qk_index))
            vo_kept.append(len(vo_index))
        keep = channel_importance(weights, squares).argsort(descending=True)[:count]
        adapter.replace_mlp_(i, static_layer(weights, keep).to(weights.up.device))
        kept.append(count)
    details: dict[str, Any] = {"attention_pruned": blocker is None, "attention_reason": blocker,
                               "kept_channels": kept, "keep_share": keep_share}
    if blocker is None:
        details.update(kept_qk_dims=qk_kept, kept_vo_dims=vo_kept)
    details["calibration"] = {"samples": cfg.calib_samples, "seq_len": seq_len, "tokens": int(batches.numel())}
    return details


STATIC_PRUNE = Method(
    name="static_prune",
    paper="baseline: static structured pruning of attention head dimensions and MLP channels by "
          "activation-aware importance (Wanda-style; Sun et al., 2024), as compared against in ToMoE and MoRE",
    summary="baseline: static head-dim + MLP-channel pruning at a matched activated-parameter ratio, no routing",
    config_cls=StaticPruneConfig,
    convert=convert,
)
