"""``llama``: a conversion that routes nothing (static pruning of MLP channels): every layer's kept
neurons, zero-padded to the widest layer's width, in a dense LLaMA checkpoint that every engine runs."""

from __future__ import annotations

from torch import Tensor
from transformers import LlamaConfig, PretrainedConfig

from moeify.export.formats.common import Source, full_rotary_reasons, max_width, mlp_tensors
from moeify.export.hf_parts import LayerParts


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
        return LlamaConfig(**source.base_fields(), intermediate_size=max_width([p.shared.width for p in parts]),
                           attention_bias=source.has("self_attn.q_proj.bias"), mlp_bias=False)

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]:
        return {key: value for part in parts for key, value in
                mlp_tensors(f"model.layers.{part.index}.mlp.", part.shared.padded(config.intermediate_size)).items()}

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        return config.num_hidden_layers * config.intermediate_size

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        return []
