"""The types moeify asks of llama.cpp's quantiser: an 8-expert file's attention typed as llama.cpp's Q4_K_M
types a model without experts (its Mixtral rule would store that attention, the dense model's, in more
bits), and no request for any other expert count. Read from a GGUF's hyperparameters alone, so no
llama.cpp is needed; the quantised files themselves are measured in ``benchmarks/serve_llamacpp.py``."""

import re

import gguf
import pytest

from moeify.export.gguf.quantize import dense_attention_types, more_bits

LAYERS = 30
# llama.cpp's use_more_bits for 30 layers: the first and last eighth (3 and 4 layers) and every third
# layer from the eighth on
MORE_BITS_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}


def _hyperparameters(path, experts):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    if experts is not None:
        writer.add_expert_count(experts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_more_bits_is_llamacpps_layer_choice():
    assert {layer for layer in range(LAYERS) if more_bits(layer, LAYERS)} == MORE_BITS_30


def test_an_8_expert_files_attention_gets_the_types_of_a_model_without_experts(tmp_path):
    types = dense_attention_types(_hyperparameters(tmp_path / "m.gguf", 8), "q4_k_m")

    def type_of(name):
        matched = [qtype for pattern, qtype in types.items() if re.search(pattern, name)]
        assert len(matched) <= 1, name
        return matched[0] if matched else None

    for layer in range(LAYERS):
        assert type_of(f"blk.{layer}.attn_v.weight") == ("q6_k" if layer in MORE_BITS_30 else "q4_k")
        assert type_of(f"blk.{layer}.attn_k.weight") == "q4_k"
        assert type_of(f"blk.{layer}.attn_output.weight") == "q4_k"
        for left in ("attn_q", "ffn_gate_exps", "ffn_down_exps", "ffn_gate_inp"):
            assert type_of(f"blk.{layer}.{left}.weight") is None  # llama.cpp's own choice
    assert type_of("output.weight") is None and type_of("token_embd.weight") is None


@pytest.mark.parametrize("experts", [None, 4, 7, 16])
def test_other_expert_counts_keep_llamacpps_choice(tmp_path, experts):
    assert dense_attention_types(_hyperparameters(tmp_path / "m.gguf", experts), "q4_k_m") == {}
