"""Static structured pruning baseline: keep, in every layer, the attention head dimensions and the MLP
channels of highest activation-aware importance (from calibration activations), at a requested
activated-parameter ratio, with no routing and no training — the kind of baseline ToMoE and MoRE
compare against. With ``finetune_steps``/``finetune_samples`` it gets CMoE's light LoRA fine-tune
(``training.lora``), so a fine-tuned method can be compared with a baseline given the same budget.

Choices:
- One kept share r = ``active_ratio`` for every projection type, so APR = r. Per layer, query/key keep
  round(r x hd/2) RoPE pairs (dimensions i and i + hd/2 together, ToMoE Appendix A.2) and value/output
  round(r x hd) dimensions, the same in every head (``moe.attention.importance`` has the scores); the
  MLP keeps the channels that bring the layer's active projections closest to r x its dense ones,
  about round(r x intermediate), absorbing the attention's rounding to whole pairs, so that the APR
  stays within one MLP channel of r per layer even with tiny heads (head_dim 8-16). At least one pair,
  one value dimension and one channel are kept, so a tiny r can end above its budget; the record's APR
  is counted, not assumed. ``keep_share`` in the details is then r.
- Measured on stories260K (head_dim 8) at APR 0.5, embedded eval slice: with attention pruned the
  perplexity is nearly twice that with ``attention=off`` (both far above the dense model's): halving a
  head this narrow costs more than the MLP channels it spares, so compare both on a real model before
  choosing.
- MLP channels are scored as in MoRE Eq. 7 / Wanda (``moe.experts.importance``).
- Layers are pruned one at a time on the outputs of the already-pruned ones (streaming), so each
  importance is measured on the inputs the pruned model really produces. Within a layer, attention and
  MLP statistics come from the same pass, through the dense layer.
- Where the attention's head dimension cannot be pruned (``moe.attention.head_dim.head_dim_support``: Qwen3's
  q/k norms, Phi-3's fused qkv, GPT-NeoX/Phi partial rotary and fused projections), or with
  ``attention=off`` (the ablation), the budget is met with MLP channels alone, the same share in every
  layer: keep = (r x P_total - P_attn) / P_mlp, and r at or below the attention's share is rejected with
  the allowed range. The returned details say which was done (``attention_pruned``) and why.
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.static_prune.config import StaticPruneConfig, match_budget

STATIC_PRUNE = Method(
    name="static_prune",
    paper="baseline: static structured pruning of attention head dimensions and MLP channels by "
          "activation-aware importance (Wanda-style; Sun et al., 2024), as compared against in ToMoE and MoRE",
    summary="baseline: static head-dim + MLP-channel pruning at a matched activated-parameter ratio, no routing",
    config_cls=StaticPruneConfig,
    convert=Deferred("moeify.methods.static_prune.convert", "convert"),
    match_budget=match_budget,
    memory=Deferred("moeify.methods.static_prune.memory", "memory"),
    inference_copy=False,
    layer_by_layer=True,
    keeps_attention=lambda config: config.attention == "off",
)

__all__ = ["STATIC_PRUNE", "StaticPruneConfig"]
