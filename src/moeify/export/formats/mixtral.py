"""``mixtral``: no shared part and no dense layers: the shared part joins every expert and a dense
layer is its whole MLP in every expert (``fold``); storage grows, per-token compute does not."""

from __future__ import annotations

from torch import Tensor
from transformers import MixtralConfig, PretrainedConfig

from moeify.export import hf_parts
from moeify.export.formats.common import Source, full_rotary_reasons, max_width, routed_tensors, routing_reasons
from moeify.export.hf_parts import LayerParts
from moeify.runtime.packed import aligned_width


class Mixtral:
    name = "mixtral"
    mlp_modules = ("mlp",)
    ties_embeddings = True
    zero_filled: tuple[str, ...] = ()

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]:
        return routing_reasons(parts, softmax_ok=False) + full_rotary_reasons(source, self.name)

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig:
        widths = [p.shared.width + max_width([e.width for e in p.experts]) for p in parts]
        return MixtralConfig(**source.base_fields(), intermediate_size=aligned_width(max(widths)),
                             num_local_experts=max_width([len(p.experts) for p in parts]), num_experts_per_tok=1,
                             sliding_window=None)

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for part in parts:
            _, experts, router = hf_parts.fold(part, 0, config.num_local_experts)
            out.update(routed_tensors(f"model.layers.{part.index}.mlp.", experts, config.intermediate_size, router))
        return out

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        return config.num_hidden_layers * config.num_experts_per_tok * config.intermediate_size

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        return [p.index for p in parts if p.shared.width]
