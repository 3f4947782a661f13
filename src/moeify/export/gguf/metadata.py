"""The architecture section of a GGUF file: which llama.cpp architecture holds a standard-format export and
the hyperparameters llama.cpp reads for it (the keys its converter writes for the same checkpoint)."""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

# standard format moeify builds -> llama.cpp architecture that runs it
ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA,
                 "granitemoeshared": gguf.MODEL_ARCH.GRANITE_MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
ROTATES_HALVES = ("qwen2_moe",)  # llama.cpp's NEOX rotary, transformers' layout: q and k stay as they are
NEEDS_OUTPUT = ("qwen2_moe",)  # llama.cpp's qwen2moe requires output.weight, tied or not


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def unsupported(fmt: str, config: PretrainedConfig) -> list[str]:
    """Why llama.cpp's architecture for ``fmt`` would not compute ``config``'s model as transformers does."""
    reasons = []
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear"):
        reasons.append(f"rotary scaling {rope['rope_type']!r}: the GGUF writer handles none and linear")
    arch = ARCHITECTURES[fmt]
    if arch != gguf.MODEL_ARCH.LLAMA and head_dim(config) * config.num_attention_heads != config.hidden_size:
        reasons.append(f"head_dim={head_dim(config)} x {config.num_attention_heads} heads != hidden_size="
                       f"{config.hidden_size}: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} derives the head size "
                       "from hidden_size")
    if fmt == "qwen2_moe" and getattr(config, "norm_topk_prob", False):  # the export's config says
        reasons.append("top-k weights renormalised over the chosen experts: llama.cpp's qwen2moe weighs them by "
                       "their softmax probability")
    return reasons


def add_hyperparameters(writer: gguf.GGUFWriter, fmt: str, config: PretrainedConfig) -> None:
    """Write what llama.cpp reads to build ``fmt``'s graph from ``config``."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim(config))
    if ARCHITECTURES[fmt] == gguf.MODEL_ARCH.LLAMA:  # llama.cpp's llama reads experts where the file has them
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
        if fmt == "mixtral":
            writer.add_expert_count(config.num_local_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
        return
    if fmt == "qwen2_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        return
    # Granite: MoE sizes and the multipliers its graph applies (moeify's export sets neutral ones)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    if config.shared_intermediate_size:
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
