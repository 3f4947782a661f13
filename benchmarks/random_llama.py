"""The LLaMA-shaped random model the speed benchmarks share, and a conversion context on a copy of it.

Hidden 1024, intermediate 2816, 16 heads of 64 dimensions, vocabulary 512 (the embedded tokenizer's,
so that the LM head does not dominate); weights from ``torch.manual_seed(0)``. Imported by the
``bench_*.py`` scripts beside it (run as ``python benchmarks/bench_x.py``)."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moeify.api import load_model
from moeify.calibration.data import EMBEDDED_CALIB, read_text
from moeify.methods import ConversionContext

HIDDEN, INTERMEDIATE, VOCAB = 1024, 2816, 512


def random_llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=VOCAB,
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def shape(layers: int) -> str:
    return f"llama h{HIDDEN} i{INTERMEDIATE} L{layers} vocab{VOCAB}"


def conversion_context(dense: LlamaForCausalLM) -> ConversionContext:
    """A method's context on a copy of ``dense`` (which stays the baseline), calibrated on the embedded
    calibration slice with the embedded tokenizer."""
    _, tokenizer = load_model(None)
    return ConversionContext(copy.deepcopy(dense), tokenizer, read_text(EMBEDDED_CALIB), 0, torch.device("cpu"),
                             progress=False)
