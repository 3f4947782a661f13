"""Removing decoder layers: a consistent shorter model, and the record that keeps the dense total."""

import pytest
import torch

from moeify.arch import DecoderAdapter
from moeify.moe.accounting import activated_parameters, removed_layers
from moeify.moe.depth import remove_layers
from tests.helpers.conversion import assert_cached_generation_equals_uncached
from tests.helpers.tiny_models import tiny_model


def test_removal_renumbers_cache_slots_and_config_and_keeps_the_dense_total():
    model = tiny_model("qwen2", num_hidden_layers=5, use_sliding_window=True, max_window_layers=3, sliding_window=8)
    types = list(model.config.layer_types)
    assert types[3:] == ["sliding_attention"] * 2
    dense = activated_parameters(model)
    kept = [DecoderAdapter(model).layer(i) for i in (1, 2, 4)]
    entries = remove_layers(model, [3, 0])
    adapter = DecoderAdapter(model)
    assert list(adapter.layers) == kept and [layer.self_attn.layer_idx for layer in kept] == [0, 1, 2]
    assert model.config.num_hidden_layers == 3 and model.config.layer_types == [types[1], types[2], types[4]]
    attn, mlp = adapter.attention_params(0), adapter.dense_mlp_params(0)
    assert entries == [{"index": 0, "attention_params": attn, "mlp_params": mlp},
                       {"index": 3, "attention_params": attn, "mlp_params": mlp}]
    assert removed_layers(model) == entries
    after = activated_parameters(model)
    assert after.total_params == dense.total_params and after.active_params == 3 * (attn + mlp)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    assert_cached_generation_equals_uncached(model, ids, 8)  # sliding and full layers keep their own cache types and masks
    remove_layers(model, [2])  # a second removal adds to the record
    assert [e["index"] for e in removed_layers(model)] == [0, 3, 2]
    assert activated_parameters(model).total_params == dense.total_params


def test_out_of_range_removal_changes_nothing():
    model = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(IndexError, match="layer 3 out of range: the model has 3 decoder layers"):
        remove_layers(model, [1, 3])
    assert model.config.num_hidden_layers == 3 and len(DecoderAdapter(model).layers) == 3
    assert removed_layers(model) == []
