"""GGUF files for llama.cpp (and Ollama, LM Studio): a standard-format export written under llama.cpp's
architecture, hyperparameter and tensor names, with the dense model's tokenizer, in f32, f16, q8_0 or a
k-quant. A routed model goes through ``granitemoeshared`` (llama.cpp's ``granitemoe``: the shared part
always on, no gate), or where only softmax weights hold its routing (Dense2MoE) through ``qwen2_moe``
(llama.cpp's ``qwen2moe``, ``qwen2moe.py``), a dense one through ``llama``."""

from __future__ import annotations

from moeify.export.gguf.metadata import ARCHITECTURES, unsupported
from moeify.export.gguf.quantize import quantiser
from moeify.export.gguf.vocab import NoGgufVocabulary, Vocabulary, vocabulary
from moeify.export.gguf.writer import QUANTS, RECORD_KEY, describe, write_gguf

__all__ = ["ARCHITECTURES", "QUANTS", "RECORD_KEY", "NoGgufVocabulary", "Vocabulary", "describe", "quantiser",
           "unsupported", "vocabulary", "write_gguf"]
