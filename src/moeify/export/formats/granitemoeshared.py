"""``granitemoeshared``: the shared MLP always on without a gate (llama.cpp-safe); see ``GraniteMoeShared``."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import GraniteMoeSharedConfig, PretrainedConfig

from moeify.export import hf_parts
from moeify.export.formats.common import (
    Source,
    full_rotary_reasons,
    max_width,
    routed_tensors,
    routing_reasons,
)
from moeify.export.hf_parts import LayerParts
from moeify.runtime.packed import aligned_width, packed_widths


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
        width = aligned_width(max(max(0, p.shared.width - shared) + max_width([e.width for e in p.experts])
                                  for p in parts))
        return GraniteMoeSharedConfig(**source.base_fields(), intermediate_size=width,
                                      shared_intermediate_size=shared,
                                      num_local_experts=max_width([len(p.experts) for p in routed]),
                                      num_experts_per_tok=routed[0].routing.top_k,
                                      attention_multiplier=source.head_dim ** -0.5, embedding_multiplier=1.0,
                                      residual_multiplier=1.0, logits_scaling=1.0,
                                      attention_bias=source.has("self_attn.q_proj.bias"))

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for part in parts:
            prefix = f"model.layers.{part.index}."
            shared, experts, router = hf_parts.fold(part, config.shared_intermediate_size, config.num_local_experts)
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
        return [p.index for p in parts if p.shared.width > config.shared_intermediate_size]
