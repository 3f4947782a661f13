"""vLLM serves a standard export with the native model's greedy tokens. Runs where vllm is importable
(``bash benchmarks/make_vllm_venv.sh && .venv-vllm/bin/python -m pytest tests/integration/test_serve_vllm.py``),
skips elsewhere; ``benchmarks/serve_vllm.py`` checks the exports of SmolLM2 by every method the same way."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import moeify
from moeify.api import export_folder
from moeify.evaluation.serving import compare_tokens, native_tokens, served_tokens
from moeify.loading import load_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (benchmarks/make_vllm_venv.sh makes a venv with it)")]


@pytest.mark.parametrize("method, options, fmt", [("more", {}, "qwen2_moe"),
                                                  ("static_prune", {"attention": "off"}, "llama")])
def test_a_served_export_gives_the_native_tokens(method, options, fmt, tmp_path):
    _, tokenizer = load_model(None)  # the embedded tokenizer (512 tokens) for the calibration text
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=False)  # head size 64: one vLLM's CPU attention runs
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    native = moeify.save(moeify.convert(str(tmp_path / "dense"), method, options, measure_speed=False),
                         tmp_path / "native")
    export_folder(native, fmt, tmp_path / "export")
    prompts = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(1)).tolist()
    expected = native_tokens(moeify.load(native), prompts, 16)
    served = served_tokens(tmp_path / "export", prompts, 16, max_model_len=256)
    assert compare_tokens(expected, served["tokens"])["identical_sequences"] == len(prompts)
