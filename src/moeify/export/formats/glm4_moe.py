"""``glm4_moe``: sigmoid router with a selection-only bias; with top-1, ``norm_topk_prob`` and
``routed_scaling_factor = 1`` the chosen expert weighs s / s = 1. The router is scaled so |scores|
<= 2 (sigmoid never saturates into ties). Sigmoid-gate weights (DSMoE's g_i, approximated at a fixed
k) are ``norm_topk_prob=False`` with the router as it is. Leading dense layers are ``first_k_dense_replace``; a later
dense layer keeps its MLP in the shared experts, the overflow in every routed expert (``fold``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers import Glm4MoeConfig, PretrainedConfig

from moeify.export import hf_parts
from moeify.export.formats.common import (
    SIGMOID_SCORE_BOUND,
    Source,
    max_width,
    mlp_tensors,
    routed_tensors,
    routing_reasons,
)
from moeify.export.hf_parts import LayerParts
from moeify.runtime.packed import packed_widths


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
        dense_after = max_width([p.shared.width for p in moe if not p.routed])
        # at least one shared expert, zero if the source has no shared part: transformers cannot build None,
        # and vLLM's CPU build dies (SIGFPE) loading a zero-width one
        n_shared = max(1, math.ceil(shared / width), math.ceil((dense_after - width) / width))
        rope = {**source.base_fields()["rope_parameters"], "partial_rotary_factor": source.rotary_fraction}
        dense_width = max_width([p.shared.width for p in parts[:k]], source.config.intermediate_size)
        return Glm4MoeConfig(**{**source.base_fields(), "rope_parameters": rope, "tie_word_embeddings": False},
                             intermediate_size=dense_width,
                             moe_intermediate_size=width, n_shared_experts=n_shared,
                             n_routed_experts=max(2, max_width([len(p.experts) for p in moe])),
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
            shared, experts, router = hf_parts.fold(part, width * config.n_shared_experts, experts_n)
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
        return [p.index for p in parts
                if p.index >= config.first_k_dense_replace and (not p.routed or (wider and p.shared.width))]
