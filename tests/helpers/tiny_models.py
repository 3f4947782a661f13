"""Tiny randomly initialised causal LMs, one per supported family, for fast exactness tests.

Shapes are chosen to catch layout mistakes: the intermediate size (88) is not a multiple of 8 and differs
from every other dimension, there are 4 query heads and (where the family supports GQA) 2 key/value
heads. Every bias and every norm parameter is given random values, because Hugging Face initialises
biases to zero and norms to the identity, and a test against zeros proves nothing about bias handling.
The helper does not disturb the caller's global RNG.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PhiConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

FAMILY_NAMES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "olmo2", "granite", "phi3",
                                 "gpt_neox", "phi")
# Configs of a supported family that exercise something more (tiny_model takes these names too).
VARIANT_NAMES: tuple[str, ...] = ("llama3",)

HIDDEN = 64
INTERMEDIATE = 88
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 128
MAX_POS = 128

# Overrides for a tiny model fed by the embedded stories260K tokenizer (ids up to 511) and calibrated
# on windows of up to 256 tokens: ``tiny_model(family, **STORIES_VOCAB)``.
STORIES_VOCAB: dict[str, int] = dict(vocab_size=512, max_position_embeddings=256)

_COMMON: dict[str, Any] = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    vocab_size=VOCAB,
    max_position_embeddings=MAX_POS,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_GQA: dict[str, Any] = dict(num_key_value_heads=KV_HEADS)
_GATED: dict[str, Any] = dict(hidden_act="silu", rms_norm_eps=1e-6)

_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (LlamaConfig, {**_GQA, **_GATED}),
    "mistral": (MistralConfig, {**_GQA, **_GATED}),
    "qwen2": (Qwen2Config, {**_GQA, **_GATED}),  # q/k/v carry biases
    "qwen3": (Qwen3Config, {**_GQA, **_GATED, "head_dim": HIDDEN // HEADS}),  # q_norm/k_norm on head_dim
    # Gemma-3: GeGLU-tanh, x * (1 + w) norms before and after attention and MLP, q/k norms, scaled and tied
    # embeddings, sliding (window 8, local RoPE base) and full layers alternating, final logit soft-capping.
    "gemma3": (Gemma3TextConfig, {**_GQA, "head_dim": HIDDEN // HEADS, "hidden_activation": "gelu_pytorch_tanh",
                                  "rms_norm_eps": 1e-6, "sliding_window": 8, "sliding_window_pattern": 2,
                                  "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16,
                                  "tie_word_embeddings": True}),
    # Gemma-2: Gemma-3's norms and GeGLU, no q/k norms, attention and final logit soft-capping.
    "gemma2": (Gemma2Config, {**_GQA, "head_dim": HIDDEN // HEADS, "hidden_activation": "gelu_pytorch_tanh",
                              "rms_norm_eps": 1e-6, "sliding_window": 8, "attn_logit_softcapping": 20.0,
                              "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16,
                              "tie_word_embeddings": True}),
    # OLMo-2: post-norm (attention and MLP outputs normalised, inputs not), q/k norms over all heads.
    "olmo2": (Olmo2Config, {**_GQA, **_GATED}),
    # Granite: LLaMA with embedding, attention, residual and logit multipliers.
    "granite": (GraniteConfig, {**_GQA, **_GATED, "embedding_multiplier": 2.0, "attention_multiplier": 0.2,
                                "residual_multiplier": 0.5, "logits_scaling": 4.0}),
    # Llama-3.x: the llama family with llama3 RoPE scaling.
    "llama3": (LlamaConfig, {**_GQA, **_GATED, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "phi3": (Phi3Config, {**_GQA, **_GATED}),  # fused qkv_proj and gate_up_proj
    # GPT-NeoX: no GQA; biases everywhere; parallel residual; rotary on 25% of each 16-dim head.
    "gpt_neox": (
        GPTNeoXConfig,
        dict(hidden_act="gelu", rotary_pct=0.25, use_parallel_residual=True, layer_norm_eps=1e-5),
    ),
    # Phi: biases everywhere (lm_head too); attention and MLP in parallel off one LayerNorm.
    "phi": (
        PhiConfig,
        {**_GQA, "hidden_act": "gelu_new", "partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5},
    ),
}


def tiny_config(family: str, **overrides: Any):
    """The config ``tiny_model`` builds from; ``overrides`` replace or add config fields."""
    if family not in _CONFIGS:
        raise KeyError(f"no tiny config for {family!r}; known: {', '.join(_CONFIGS)}")
    cls, extra = _CONFIGS[family]
    return cls(**{**_COMMON, **extra, **overrides})


def _randomise_biases_and_norms_(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower()
            weight = getattr(module, "weight", None)
            if is_norm and isinstance(weight, torch.nn.Parameter):
                weight.copy_(1.0 + 0.1 * torch.randn_like(weight))
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter):
                bias.copy_(0.1 * torch.randn_like(bias))


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny fp32 causal LM of ``family`` in eval mode, deterministic in ``seed``.

    ``overrides`` are config fields, e.g. ``tiny_model("llama", mlp_bias=True)`` for a gated MLP with biases.
    Attention runs through SDPA, eager where the family soft-caps attention scores (SDPA cannot).
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"  # sdpa cannot cap
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        _randomise_biases_and_norms_(model)
    return model.to(torch.float32).eval()
