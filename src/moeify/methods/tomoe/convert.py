"""ToMoE's conversion after training (§3.5, Appendix A.1, Fig. 8): learned masks -> real MoE modules.

- Budget: a short training run may end before R_P reaches 0, so every mask (MLP s_e, attention s_0 and
  s_t) thresholds its logits at the one value theta, shared by all layers and both module kinds, at
  which the activated attention + MLP parameters meet p T_total as R_P defines it: theta = 0 when
  training converged (``budget_threshold``, recorded as ``mask_threshold``). Correcting the MLP alone
  would leave an unconverged attention wide and take the whole correction out of the MLPs.
- MLP: s_e = round(sigmoid(Proj_D^MLP(E) + b)) (Eq. 11 without noise: inference is deterministic); the
  hypernetwork and Proj_D^MLP are dropped.
  Every expert is widened to the layer's widest expert (the paper
  "adjust[s] the width of all experts to match the maximum size among them") with the union neurons of
  highest Proj_D^MLP logit it lacks, so only neurons in the union of experts are kept. The layer becomes
  an ``MoeMLP`` whose experts are those neuron subsets (Eq. 12) with an ``ArgmaxRouter`` (top-1, unscaled
  output, Eq. 13). The experts overlap, so they are stored once (``SharedNeuronExperts``: the union and
  each expert's index list, as the official code keeps masks), which also gives Appendix B.3's pseudo-MoE.
  The neurons every expert of a layer has become its always-on shared part (``common_neurons_shared``):
  with one expert per token at weight 1 the function is the same, and the common part, most of each
  expert once trained (on SmolLM2 after the default 600 steps), runs as a dense product rather than
  inside the routed experts, natively and in an export.
- Attention: Q/K keep the dimensions of the noise-free s_0' (at least one pair); V/O become top-K routing,
  K = round(mean over calibration tokens of the noise-free s_t count, at least 1) (§3.3), with the mean expert
  embedding folded into Proj_E^MHA's bias (§3.5): a ``PrunedAttention`` with a ``HeadDimRouter``.
  With head pruning (``attention=heads``, Table 13's abandoned variant, which the paper does not describe
  further) the key/value heads whose noise-free mask passes theta (at least one) are kept whole with their
  query heads: a ``PrunedAttention`` with fewer heads and no router.
- Precision: a bfloat16/float16 model is held in float32 while Theta trains and the masks become modules
  (``frozen_weights=float32``, the default), so its conversion is the float32 conversion of the same
  weights, rounded. The paper trains over a frozen bfloat16 model; at a CPU budget of a few hundred steps
  ToMoE's hard masks make where a run lands depend on the smallest change of its gradients, and under
  bfloat16 autocast (``frozen_weights=working``, half the weights' memory) SmolLM2's 250-step conversion
  landed a few percent in perplexity from the float32 one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from moeify.calibration.data import calibration_batches
from moeify.methods.base import Conversion, ConversionContext
from moeify.methods.tomoe.config import EMBED_DIM, TomoeConfig
from moeify.methods.tomoe.modules import KEEP_BIAS
from moeify.methods.tomoe.train import MaskedModel, TomoeModules, learned_masks
from moeify.moe.accounting import layer_attention_counts
from moeify.moe.attention.head_dim import head_dim_support, head_group_costs, pruned_attention, rope_pairs
from moeify.moe.experts.build import common_neurons_shared
from moeify.options import OptionError, require_work_dir_for_resume
from moeify.plots import training_curves
from moeify.runtime.attention import HeadDimRouter, pruned_projection_params
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import ArgmaxRouter
from moeify.training.precision import held_in_float32

CURVES_PNG = "tomoe_training.png"


def resolve_attention(ctx: ConversionContext, cfg: TomoeConfig) -> tuple[TomoeConfig, str | None]:
    """``cfg`` with ``attention=auto`` made on or off for this model, and why attention cannot be on here
    (None: it can); ``attention=on`` where it cannot is refused."""
    blocker = head_dim_support(ctx.adapter, 0)
    if cfg.attention in ("on", "heads") and blocker:
        raise OptionError(f"attention={cfg.attention} is not possible for this model: {blocker}; use attention=off")
    if cfg.attention == "auto":
        cfg = replace(cfg, attention="off" if blocker else "on")
    return cfg, blocker


def convert(ctx: ConversionContext, cfg: TomoeConfig) -> Conversion:
    require_work_dir_for_resume(cfg.resume, ctx.work_dir)
    cfg, blocker = resolve_attention(ctx, cfg)
    seq_len = cfg.effective_seq_len(ctx.model.config)
    # float32 frozen weights: a bfloat16 conversion takes the float32 conversion's steps and decisions exactly
    held = held_in_float32(ctx.model) if cfg.frozen_weights == "float32" else nullcontext()
    with held, learned_masks(ctx, cfg, seq_len) as (theta, masked, log):
        structure = convert_(ctx, theta, masked, cfg, seq_len)
    task = ("KD loss", "kd") if cfg.objective == "kd" else ("LM loss", "lm")
    curves = {name: log["curves"][key] for name, key in (task, ("R_P", "r_p"), ("R_U", "r_u"), ("R_L", "r_l"),
                                                         ("T / T_total", "ratio"))}
    details = {**structure, "attention": cfg.attention, "attention_blocked": blocker, "train_seq_len": seq_len,
               "training": log, "curves_png": CURVES_PNG}
    png = training_curves(curves, title=f"ToMoE training (p = {cfg.active_ratio})")
    return Conversion(ctx.model, details, {CURVES_PNG: png})


def widened_experts(logits: Tensor, threshold: float = 0.0) -> list[Tensor]:
    """Each expert's neurons (ascending), widened to the widest expert's count from the union (Fig. 8).

    ``logits``: (N, d_mid) noise-free Proj_D^MLP(E) + b; an expert keeps neuron j where logits > threshold."""
    keep = logits > threshold
    union = keep.any(dim=0)
    if not union.any():  # degenerate: no expert keeps anything; keep the single most wanted neuron
        union[logits.max(dim=0).values.argmax()] = True
    width = max(int(keep.sum(dim=1).max()), 1)
    sets = []
    for own, score in zip(keep, logits):
        ranked = score.masked_fill(~union, float("-inf")).masked_fill(own, float("inf"))
        sets.append(ranked.topk(width).indices.sort().values)
    return sets


def expert_width(logits: Tensor, threshold: float) -> int:
    return max(int((logits > threshold).sum(dim=1).max()), 1)


def mlp_cost(logits: list[Tensor], per_neuron: list[int]) -> Callable[[float], float]:
    """The MLPs' activated parameters at threshold theta: the widest expert of each layer (Eq. 8)."""
    return lambda theta: sum(expert_width(x, theta) * p for x, p in zip(logits, per_neuron))


def budget_threshold(cost: Callable[[float], float], logits: list[Tensor], budget: float) -> float:
    """The mask threshold theta at which ``cost(theta)`` (activated parameters, falling as theta rises)
    comes closest to ``budget`` from below: R_P's target, met exactly; ``logits`` bound the search."""
    every = torch.cat([x.flatten() for x in logits])
    low, high = float(every.min()) - 1.0, float(every.max()) + 1.0  # cost(low) is the widest, cost(high) the least
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cost(mid) > budget else (low, mid)
    return high


def _kept(logits: Tensor, theta: float) -> Tensor:
    """The indices whose logit passes ``theta``; the largest one where none does (a mask keeps something)."""
    kept = (logits > theta).nonzero().flatten()
    return kept if kept.numel() else logits.argmax().reshape(1)


@dataclass(frozen=True)
class AttentionLogits:
    """One layer's noise-free attention mask logits (b included): s_0's half head (head_dim / 2,) and s_t
    of every calibration token (tokens, head_dim), or the static V/O mask's (1, head_dim) without V/O
    routing; ``geometry``: what ``pruned_projection_params`` needs."""

    qk_half: Tensor
    vo_tokens: Tensor
    geometry: tuple[int, int, int, bool, bool]  # hidden, heads, kv_heads, qkv bias, o bias

    def kept_pairs(self, theta: float) -> Tensor:
        return _kept(self.qk_half, theta)

    def kept_vo(self, theta: float) -> Tensor:
        """The static V/O mask's kept dimensions (``vo_routing=false``)."""
        return _kept(self.vo_tokens[0], theta)

    def vo_top_k(self, theta: float) -> int:
        return max(1, round(float((self.vo_tokens > theta).sum(1).float().mean())))

    def cost(self, theta: float) -> int:
        hidden, heads, kv_heads, qkv_bias, o_bias = self.geometry
        return pruned_projection_params(hidden, heads, kv_heads, 2 * len(self.kept_pairs(theta)), self.vo_top_k(theta),
                                        qkv_bias, o_bias)

    def bounds(self) -> list[Tensor]:
        return [self.qk_half, self.vo_tokens]


@dataclass(frozen=True)
class HeadLogits:
    """One layer's noise-free head-pruning mask logits (b included), one per key/value head, and what a
    kept head (with its query heads) and the layer's rest cost (``head_group_costs``)."""

    heads: Tensor
    per_group: int
    fixed: int

    def kept(self, theta: float) -> Tensor:
        return _kept(self.heads, theta)

    def cost(self, theta: float) -> int:
        return len(self.kept(theta)) * self.per_group + self.fixed

    def bounds(self) -> list[Tensor]:
        return [self.heads]


def _head_logits(adapter: Any, theta: TomoeModules, embeddings: Tensor) -> list[HeadLogits]:
    """Every layer's noise-free head-pruning logits: static, so no calibration pass."""
    return [HeadLogits(m.proj_heads(m.attention_embedding(embeddings[i])) + KEEP_BIAS, *head_group_costs(adapter, i))
            for i, m in enumerate(theta.layers)]


def _attention_logits(ctx: ConversionContext, theta: TomoeModules, masked: MaskedModel, cfg: TomoeConfig,
                      seq_len: int, embeddings: Tensor) -> list[AttentionLogits]:
    """Every layer's noise-free s_0 and s_t logits, s_t over the calibration tokens (§3.3)."""
    for part in (*masked.mlps, *masked.attention):
        part.noise = None
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    tokens: list[list[Tensor]] = [[] for _ in masked.attention]
    for batch in batches.split(1):
        ctx.model(input_ids=batch.to(ctx.device), use_cache=False)
        for i, masks in enumerate(masked.attention):
            tokens[i].append(masks.token_logits.reshape(-1, masks.head_dim) + KEEP_BIAS)
    adapter = ctx.adapter
    out = []
    for i, modules in enumerate(theta.layers):
        attn, proj = adapter.attention_module(i), adapter.attention_projections(i)
        heads, kv_heads = proj["q"].out_features // attn.head_dim, proj["k"].out_features // attn.head_dim
        geometry = (proj["q"].in_features, heads, kv_heads, proj["v"].bias is not None, proj["o"].bias is not None)
        vo = torch.cat(tokens[i]) if cfg.vo_routing else tokens[i][0]  # a static mask: every pass's the same
        out.append(AttentionLogits(modules.proj_qk(modules.attention_embedding(embeddings[i])) + KEEP_BIAS, vo,
                                   geometry))
    return out


def convert_(ctx: ConversionContext, theta: TomoeModules, masked: MaskedModel, cfg: TomoeConfig,
             seq_len: int) -> dict[str, Any]:
    """Replace the masked model's MLPs and attentions by ToMoE's MoE modules, in place; returns the
    per-layer structure for the record."""
    adapter = ctx.adapter
    with torch.no_grad():
        embeddings = theta.hypernet()
        masked.set_embeddings(embeddings)
        attention: list[AttentionLogits] | list[HeadLogits] = []
        if cfg.attention == "heads":
            attention = _head_logits(adapter, theta, embeddings)
        elif masked.attention:
            attention = _attention_logits(ctx, theta, masked, cfg, seq_len, embeddings)
        masked.restore()
        output_biases = sum(0 if w.down_bias is None else w.down_bias.numel() for w in masked.weights)
        all_logits = [m.proj_mlp(embeddings[i]) + KEEP_BIAS for i, m in enumerate(theta.layers)]
        mlps = mlp_cost(all_logits, [w.params_per_neuron() for w in masked.weights])
        if attention:  # one threshold over attention and MLP masks, as R_P counts both
            cost = lambda t: mlps(t) + sum(a.cost(t) for a in attention)  # noqa: E731
            bounds = all_logits + [x for a in attention for x in a.bounds()]
            theta_ = budget_threshold(cost, bounds, cfg.active_ratio * masked.total - output_biases)
        else:
            dense_attention = sum(layer_attention_counts(adapter, i, measured=False)[1]
                                  for i in range(adapter.num_layers))
            theta_ = budget_threshold(mlps, all_logits, cfg.active_ratio * masked.total - dense_attention - output_biases)
        layers: list[dict[str, Any]] = [{} for _ in theta.layers]
        for i, (modules, logits) in enumerate(zip(theta.layers, attention)):
            layers[i].update(_prune_attention_(adapter, i, modules, modules.attention_embedding(embeddings[i]),
                                               logits, theta_))
        for i, (modules, weights, logits) in enumerate(zip(theta.layers, masked.weights, all_logits)):
            sets = widened_experts(logits, theta_)
            router = ArgmaxRouter(weights.hidden_size, cfg.num_experts)
            router.proj.weight.copy_(modules.router.weight)
            down_bias = None if weights.down_bias is None else weights.down_bias.clone()
            shared, experts = common_neurons_shared(weights, sets)
            layer = MoeMLP(experts, router, shared, down_bias, dense_width=weights.intermediate_size)
            adapter.replace_mlp_(i, layer.to(weights.up.device))
            layers[i].update({"expert_width": len(sets[0]), "shared_width": 0 if shared is None else shared.width,
                              "own_widths": (logits > theta_).sum(dim=1).tolist(),
                              "union": int((logits > theta_).any(dim=0).sum()),
                              "intermediate_size": weights.intermediate_size})
    return {"layers": layers, "mask_threshold": theta_}


def _prune_attention_(adapter: Any, i: int, modules: Any, embedding: Tensor, logits: AttentionLogits | HeadLogits,
                      theta: float) -> dict[str, int]:
    """Layer i's attention with the Q/K pairs kept at ``theta`` (s_0 over the first half of the head,
    Appendix A.2) and the V/O top-K router, or the static V/O dimensions without V/O routing; with head
    pruning, the key/value heads kept at ``theta`` (at least one) with their query heads, whole."""
    attn = adapter.attention_module(i)
    if isinstance(logits, HeadLogits):
        kept = logits.kept(theta)
        every = torch.arange(attn.head_dim)
        adapter.replace_attention_(i, pruned_attention(adapter, i, every, vo_index=every, kept_kv_heads=kept))
        return {"kv_heads": len(kept), "dense_kv_heads": len(logits.heads)}
    qk_index = rope_pairs(logits.kept_pairs(theta), attn.head_dim)
    sizes = {"qk_dims": len(qk_index), "head_dim": attn.head_dim}
    if not modules.vo_routing:
        vo_index = logits.kept_vo(theta)
        adapter.replace_attention_(i, pruned_attention(adapter, i, qk_index, vo_index=vo_index))
        return {**sizes, "vo_dims": len(vo_index)}
    top_k = logits.vo_top_k(theta)
    hidden = adapter.attention_projections(i)["q"].in_features
    router = HeadDimRouter(hidden, attn.head_dim, EMBED_DIM, top_k).to(embedding)
    router.proj_e.weight.copy_(modules.proj_e.weight)
    router.proj_e.bias.copy_(modules.proj_e.bias + embedding)  # (1/N) 1^T E as Proj_E's bias (§3.5)
    router.norm.load_state_dict(modules.proj_vo[0].state_dict())
    router.proj_d.load_state_dict(modules.proj_vo[2].state_dict())
    adapter.replace_attention_(i, pruned_attention(adapter, i, qk_index, router=router))
    return {**sizes, "vo_top_k": top_k}
