"""``qwen2_moe``: the shared expert is always-on exactly: a zero ``shared_expert_gate`` gives
sigmoid(0) = 1/2 and the doubled down projection undoes it (both powers of two: bit-exact). Dense
layers are ``mlp_only_layers``. Unit top-1 is ``norm_topk_prob=True`` (p / p = 1); Dense2MoE-style
softmax weights are ``norm_topk_prob=False`` with any top-k; renormalised top-k weights (distilled
routers of unit top-k ones, ``hf_distill``) are ``norm_topk_prob=True``."""

from __future__ import annotations

from torch import Tensor
from transformers import PretrainedConfig, Qwen2MoeConfig

from moeify.export import hf_parts
from moeify.export.formats.common import (
    Source,
    full_rotary_reasons,
    max_width,
    mlp_tensors,
    routed_tensors,
    routing_reasons,
)
from moeify.export.hf_parts import GatedMlp, LayerParts
from moeify.runtime.packed import aligned_width, packed_widths


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
                              intermediate_size=max_width([p.shared.width for p in dense],
                                                          source.config.intermediate_size),
                              moe_intermediate_size=width,
                              shared_expert_intermediate_size=shared or aligned_width(1),  # no zero-size tensors
                              num_experts=max_width([len(p.experts) for p in routed]),
                              num_experts_per_tok=routed[0].routing.top_k,
                              norm_topk_prob=routed[0].routing.weighting in ("unit", "renormalised"))

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for part in parts:
            prefix = f"model.layers.{part.index}.mlp."
            if not part.routed:
                out.update(mlp_tensors(prefix, part.shared.padded(config.intermediate_size)))
                continue
            shared, experts, router = hf_parts.fold(part, config.shared_expert_intermediate_size, config.num_experts)
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
        return []
