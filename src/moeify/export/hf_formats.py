"""The standard Hugging Face MoE architectures moeify writes, each as data plus two functions.

A format says why it cannot represent a model (``explain``), builds transformers' own config for it
(``config``) and the tensors of every MLP slot under the names of transformers' in-memory modules
(``tensors``); ``hf_export`` instantiates transformers' model class from that config, copies attention,
norms and embeddings by name, and lets ``save_pretrained`` write the checkpoint layout engines read.

How each format represents a conversion exactly (routing must be linear and, except qwen2_moe's
softmax case, unit-weight top-1; every expert is zero-padded to one aligned width W and the shared part
to an aligned S: ``runtime.moe.packed_widths``, the widths the native runtime computes with, so a block
that holds a layer at those widths computes the native layer's float32 sums in the same order):

* ``glm4_moe``: sigmoid router with a selection-only bias; with top-1, ``norm_topk_prob`` and
  ``routed_scaling_factor = 1`` the chosen expert weighs s / s = 1. The router is scaled so |scores|
  <= 2 (sigmoid never saturates into ties). Sigmoid-gate weights (DSMoE's g_i, approximated at a fixed
  k) are ``norm_topk_prob=False`` with the router as it is. Leading dense layers are ``first_k_dense_replace``; a later
  dense layer keeps its MLP in the shared experts, the overflow in every routed expert (``fold``).
* ``qwen2_moe``: the shared expert is always-on exactly: a zero ``shared_expert_gate`` gives
  sigmoid(0) = 1/2 and the doubled down projection undoes it (both powers of two: bit-exact). Dense
  layers are ``mlp_only_layers``. Unit top-1 is ``norm_topk_prob=True`` (p / p = 1); Dense2MoE-style
  softmax weights are ``norm_topk_prob=False`` with any top-k; renormalised top-k weights (distilled
  routers of unit top-k ones, ``hf_distill``) are ``norm_topk_prob=True``.
* ``mixtral``: no shared part and no dense layers: the shared part joins every expert and a dense
  layer is its whole MLP in every expert (``fold``); storage grows, per-token compute does not.
* ``granitemoeshared``: the shared MLP always on without a gate (llama.cpp-safe); see ``GraniteMoeShared``.
* ``llama``: a conversion that routes nothing (static pruning of MLP channels): every layer's kept
  neurons, zero-padded to the widest layer's width, in a dense LLaMA checkpoint that every engine runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import (
    Glm4MoeConfig,
    GraniteMoeSharedConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
)

from moeify.export.hf_parts import GatedMlp, LayerParts, fold
from moeify.runtime.packed import aligned_width, packed_widths

SIGMOID_SCORE_BOUND = 2.0  # |router score| kept below this: sigmoid stays strictly increasing in fp32


@dataclass(frozen=True)
class Source:
    """What a format needs from the source model beyond its MLPs: the config and the names of the
    tensors outside the MLP slots (attention, norms, embeddings)."""

    config: PretrainedConfig
    keys: frozenset[str]

    def has(self, suffix: str) -> bool:
        return any(key.endswith(suffix) for key in self.keys)

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def rotary_fraction(self) -> float:
        rope = getattr(self.config, "rope_parameters", None) or {}
        return float(rope.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", None) or 1.0))

    def base_fields(self) -> dict[str, Any]:
        """Config fields every target shares with a LLaMA-style source, copied as they are."""
        cfg = self.config
        fields = {name: getattr(cfg, name) for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range", "attention_dropout",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")}
        rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        return {**fields, "head_dim": self.head_dim, "rope_parameters": rope}


class TargetFormat(Protocol):
    name: str
    ties_embeddings: bool        # whether engines honour tie_word_embeddings for this architecture
    zero_filled: tuple[str, ...]  # target tensors the source may lack, written as zeros (exact)
    mlp_modules: tuple[str, ...]  # the decoder layer's modules that hold its MLP (their outputs add up)

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]: ...

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig: ...

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]: ...

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        """MLP neurons a token runs through the whole model in this layout, zero padding included: what the
        format's widths cost (``HfExporter.cheapest_dense_layers`` compares layouts by it)."""
        ...

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        """Layers whose MLP the format holds in another arrangement or width than moeify's runtime computes
        it (a shared part or a dense MLP folded into the experts, a wider shared part): the same function,
        other float32 sums. Every other layer's block computes the native layer's sums in the same order."""
        ...


def routing_reasons(parts: list[LayerParts], softmax_ok: bool, renormalised_ok: bool = False,
                    sigmoid_ok: bool = False) -> list[str]:
    """Why the routers of ``parts`` do not fit one global router setting of a format."""
    routed = [p for p in parts if p.routed]
    if not routed:
        return ["no layer is routed (the model is dense); there is no MoE to export"]
    kinds = {(p.routing.weighting, p.routing.top_k) for p in routed}
    if len(kinds) > 1:
        return [f"layers route differently ({sorted(kinds)}); a format has one router setting for all layers"]
    (weighting, top_k), = kinds
    if weighting == "unit" and top_k != 1:
        return [f"{top_k} experts per token each with weight 1: the formats' weights are router scores "
                "(renormalised or not), exactly 1 only for top-1; for a non-linear router (CMoE) --approximate "
                "fits routers whose renormalised weights are 1 within 1e-3 (qwen2_moe, granitemoeshared)"]
    if weighting == "softmax" and not softmax_ok:
        return ["softmax-probability expert weights (not renormalised) are qwen2_moe's norm_topk_prob=False only"]
    if weighting == "renormalised" and not renormalised_ok:
        return ["top-k weights renormalised over the chosen experts, beside an always-on part: qwen2_moe's "
                "norm_topk_prob=True and granitemoeshared only"]
    if weighting == "sigmoid" and not sigmoid_ok:
        return ["sigmoid-gate expert weights (not renormalised) are glm4_moe's norm_topk_prob=False only"]
    if weighting in ("softmax", "renormalised", "sigmoid") and len({len(p.experts) for p in routed}) > 1:
        return [f"with {weighting} weights every routed layer needs the same number of experts "
                "(a padding expert would change the probabilities)"]
    return []


def full_rotary_reasons(source: Source, name: str) -> list[str]:
    if source.rotary_fraction != 1.0:
        return [f"rotary embedding covers {source.rotary_fraction} of each head; {name} rotates whole heads"]
    return []


def mlp_tensors(prefix: str, mlp: GatedMlp) -> dict[str, Tensor]:
    return {f"{prefix}gate_proj.weight": mlp.gate, f"{prefix}up_proj.weight": mlp.up,
            f"{prefix}down_proj.weight": mlp.down}


def routed_tensors(prefix: str, experts: list[GatedMlp], width: int, router: Tensor,
                   router_name: str = "gate") -> dict[str, Tensor]:
    """Experts stacked as transformers 5 holds them: gate_up_proj (E, 2 width, d) with gate rows first
    (``.chunk(2)`` gives gate, up), down_proj (E, d, width); the router weight (E, d)."""
    padded = [e.padded(width) for e in experts]
    return {f"{prefix}experts.gate_up_proj": torch.stack([torch.cat([e.gate, e.up]) for e in padded]),
            f"{prefix}experts.down_proj": torch.stack([e.down for e in padded]),
            f"{prefix}{router_name}.weight": router}


def unpadded_shared(parts: list[LayerParts], shared_width: int) -> list[int]:
    """Routed layers whose shared part the runtime computes at its own width (``LayerParts.shared_packed``)
    where the format pads it to ``shared_width``: the same function, other float32 sums."""
    return [p.index for p in parts if p.routed and not p.shared_packed and p.shared.width not in (0, shared_width)]


def _max(values: list[int], default: int = 0) -> int:
    return max(values, default=default)


class Glm4Moe:
    name = "glm4_moe"
    mlp_modules = ("mlp",)
    ties_embeddings = False  # vLLM's Glm4MoeForCausalLM always loads its own lm_head
    zero_filled: tuple[str, ...] = ()

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]:
        return routing_reasons(parts, softmax_ok=False, sigmoid_ok=True)

    @staticmethod
    def _sigmoid(parts: list[LayerParts]) -> bool:
        return any(p.routed and p.routing.weighting == "sigmoid" for p in parts)

    @staticmethod
    def _leading_dense(parts: list[LayerParts]) -> int:
        return next((n for n, p in enumerate(parts) if p.routed), len(parts))

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig:
        k = self._leading_dense(parts)
        moe = parts[k:]
        width, shared = packed_widths([e.width for p in moe for e in p.experts],
                                      [p.shared.width for p in moe if p.routed])
        dense_after = _max([p.shared.width for p in moe if not p.routed])
        # at least one shared expert, zero if the source has no shared part: transformers cannot build None,
        # and vLLM's CPU build dies (SIGFPE) loading a zero-width one
        n_shared = max(1, math.ceil(shared / width), math.ceil((dense_after - width) / width))
        rope = {**source.base_fields()["rope_parameters"], "partial_rotary_factor": source.rotary_fraction}
        dense_width = _max([p.shared.width for p in parts[:k]], source.config.intermediate_size)
        return Glm4MoeConfig(**{**source.base_fields(), "rope_parameters": rope, "tie_word_embeddings": False},
                             intermediate_size=dense_width,
                             moe_intermediate_size=width, n_shared_experts=n_shared,
                             n_routed_experts=max(2, _max([len(p.experts) for p in moe])),
                             num_experts_per_tok=moe[0].routing.top_k if moe else 1, first_k_dense_replace=k,
                             n_group=1, topk_group=1, norm_topk_prob=not self._sigmoid(parts),
                             routed_scaling_factor=1.0, use_qk_norm=source.has("self_attn.q_norm.weight"),
                             attention_bias=source.has("self_attn.q_proj.bias"), num_mtp_layers=0)

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        width, experts_n = config.moe_intermediate_size, config.n_routed_experts
        sigmoid = self._sigmoid(parts)  # the scores' own sigmoid weighs the experts: not rescaled
        for part in parts:
            prefix = f"model.layers.{part.index}.mlp."
            if part.index < config.first_k_dense_replace:
                out.update(mlp_tensors(prefix, part.shared.padded(config.intermediate_size)))
                continue
            shared, experts, router = fold(part, width * config.n_shared_experts, experts_n)
            largest = float(router.norm(dim=-1).max())
            scale = SIGMOID_SCORE_BOUND / (part.input_bound * largest) if largest > 0 and not sigmoid else 1.0
            out.update(mlp_tensors(prefix + "shared_experts.", shared))
            out.update(routed_tensors(prefix, experts, width, router * scale))
            out[prefix + "gate.e_score_correction_bias"] = torch.zeros(experts_n, dtype=torch.float32)
        return out

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        k, moe = config.first_k_dense_replace, config.num_hidden_layers - config.first_k_dense_replace
        return k * config.intermediate_size + moe * (config.n_shared_experts + config.num_experts_per_tok) \
            * config.moe_intermediate_size

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        """Dense layers after the leading ones, and shared parts when n x W is wider than the runtime's S."""
        routed = [p for p in parts if p.routed]
        _, shared = packed_widths([e.width for p in routed for e in p.experts], [p.shared.width for p in routed])
        stored = config.n_shared_experts * config.moe_intermediate_size
        wider = stored != shared
        return sorted({p.index for p in parts
                       if p.index >= config.first_k_dense_replace and (not p.routed or (wider and p.shared.width))}
                      | set(unpadded_shared(parts, stored)))


class Qwen2Moe:
    name = "qwen2_moe"
    mlp_modules = ("mlp",)
    ties_embeddings = True
    # vLLM builds qwen2_moe's q/k/v projections with biases: a source without them gets zero biases.
    zero_filled = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]:
        reasons = routing_reasons(parts, softmax_ok=True, renormalised_ok=True) + full_rotary_reasons(source, self.name)
        cfg = source.config
        if source.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            reasons.append(f"head_dim={source.head_dim} x {cfg.num_attention_heads} heads != hidden_size="
                           f"{cfg.hidden_size}; vLLM's qwen2_moe derives head_dim from hidden_size")
        return reasons

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig:
        routed = [p for p in parts if p.routed]
        dense = [p for p in parts if not p.routed]
        width, shared = packed_widths([e.width for p in routed for e in p.experts], [p.shared.width for p in routed])
        return Qwen2MoeConfig(**source.base_fields(), qkv_bias=True, use_sliding_window=False,
                              mlp_only_layers=[p.index for p in dense], decoder_sparse_step=1,
                              intermediate_size=_max([p.shared.width for p in dense], source.config.intermediate_size),
                              moe_intermediate_size=width,
                              shared_expert_intermediate_size=shared or aligned_width(1),  # no zero-size tensors
                              num_experts=_max([len(p.experts) for p in routed]),
                              num_experts_per_tok=routed[0].routing.top_k,
                              norm_topk_prob=routed[0].routing.weighting in ("unit", "renormalised"))

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for part in parts:
            prefix = f"model.layers.{part.index}.mlp."
            if not part.routed:
                out.update(mlp_tensors(prefix, part.shared.padded(config.intermediate_size)))
                continue
            shared, experts, router = fold(part, config.shared_expert_intermediate_size, config.num_experts)
            # sigmoid(0) = 1/2 times a doubled down projection: the shared expert always-on, bit-exactly.
            out.update(mlp_tensors(prefix + "shared_expert.", GatedMlp(shared.gate, shared.up, shared.down * 2)))
            out[prefix + "shared_expert_gate.weight"] = shared.up.new_zeros(1, shared.up.shape[1])
            out.update(routed_tensors(prefix, experts, config.moe_intermediate_size, router))
        return out

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        dense = len(config.mlp_only_layers)
        routed = config.shared_expert_intermediate_size + config.num_experts_per_tok * config.moe_intermediate_size
        return dense * config.intermediate_size + (config.num_hidden_layers - dense) * routed

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        return unpadded_shared(parts, config.shared_expert_intermediate_size)


class Mixtral:
    name = "mixtral"
    mlp_modules = ("mlp",)
    ties_embeddings = True
    zero_filled: tuple[str, ...] = ()

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]:
        return routing_reasons(parts, softmax_ok=False) + full_rotary_reasons(source, self.name)

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig:
        widths = [p.shared.width + _max([e.width for e in p.experts]) for p in parts]
        return MixtralConfig(**source.base_fields(), intermediate_size=aligned_width(max(widths)),
                             num_local_experts=_max([len(p.experts) for p in parts]), num_experts_per_tok=1,
                             sliding_window=None)

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for part in parts:
            _, experts, router = fold(part, 0, config.num_local_experts)
            out.update(routed_tensors(f"model.layers.{part.index}.mlp.", experts, config.intermediate_size, router))
        return out

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        return config.num_hidden_layers * config.num_experts_per_tok * config.intermediate_size

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        return [p.index for p in parts if p.shared.width]


class GraniteMoeShared:
    """Granite's MoE with an always-on shared MLP that has no gate: the format llama.cpp runs for a model
    with a shared part (its qwen2_moe computes the shared-expert gate through silu(x) / x, NaN at the zero
    gate). Every layer is routed: a dense layer (or a shared part wider than the others') keeps S neurons
    in the shared MLP and the rest in every routed expert behind a zero router (``fold``). Its router
    weighs the top-k by a softmax over their scores: exactly 1 for top-1, and the renormalised weights of
    a distilled top-k router. The multipliers are Granite's neutral ones (attention 1 / sqrt(head_dim))."""

    name = "granitemoeshared"
    mlp_modules = ("block_sparse_moe", "shared_mlp")
    ties_embeddings = True
    zero_filled = ("self_attn.o_proj.bias",)  # attention_bias with a source's q/k/v biases (Qwen2)

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]:
        return routing_reasons(parts, softmax_ok=False, renormalised_ok=True) + full_rotary_reasons(source, self.name)

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig:
        routed = [p for p in parts if p.routed]
        _, shared = packed_widths([e.width for p in routed for e in p.experts], [p.shared.width for p in routed])
        width = aligned_width(max(max(0, p.shared.width - shared) + _max([e.width for e in p.experts])
                                  for p in parts))
        return GraniteMoeSharedConfig(**source.base_fields(), intermediate_size=width,
                                      shared_intermediate_size=shared,
                                      num_local_experts=_max([len(p.experts) for p in routed]),
                                      num_experts_per_tok=routed[0].routing.top_k,
                                      attention_multiplier=source.head_dim ** -0.5, embedding_multiplier=1.0,
                                      residual_multiplier=1.0, logits_scaling=1.0,
                                      attention_bias=source.has("self_attn.q_proj.bias"))

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for part in parts:
            prefix = f"model.layers.{part.index}."
            shared, experts, router = fold(part, config.shared_intermediate_size, config.num_local_experts)
            if config.shared_intermediate_size:
                out[prefix + "shared_mlp.input_linear.weight"] = torch.cat([shared.gate, shared.up])
                out[prefix + "shared_mlp.output_linear.weight"] = shared.down
            out.update(routed_tensors(prefix + "block_sparse_moe.", experts, config.intermediate_size, router,
                                      router_name="router"))
        return out

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        return config.num_hidden_layers * (config.shared_intermediate_size
                                           + config.num_experts_per_tok * config.intermediate_size)

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        return sorted({p.index for p in parts if p.shared.width > config.shared_intermediate_size}
                      | set(unpadded_shared(parts, config.shared_intermediate_size)))


class Llama:
    name = "llama"
    mlp_modules = ("mlp",)
    ties_embeddings = True
    # a source with q/k/v biases (Qwen2) gets LLaMA's attention_bias, whose o_proj bias it lacks: zero
    zero_filled = ("self_attn.o_proj.bias",)

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]:
        routed = [str(p.index) for p in parts if p.routed]
        if routed:
            return [f"layers {', '.join(routed)} route tokens to experts; llama is dense (export to a MoE format)"]
        return full_rotary_reasons(source, self.name)

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig:
        return LlamaConfig(**source.base_fields(), intermediate_size=_max([p.shared.width for p in parts]),
                           attention_bias=source.has("self_attn.q_proj.bias"), mlp_bias=False)

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        return {key: value for part in parts for key, value in
                mlp_tensors(f"model.layers.{part.index}.mlp.", part.shared.padded(config.intermediate_size)).items()}

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        return config.num_hidden_layers * config.intermediate_size

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        return []


FORMATS: dict[str, TargetFormat] = {f.name: f for f in (Glm4Moe(), Qwen2Moe(), Mixtral(), GraniteMoeShared(), Llama())}
