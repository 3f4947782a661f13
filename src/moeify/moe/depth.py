"""Removing whole decoder layers from a model, with the record that keeps its parameter accounting honest.

The model that results is a plain, shorter model of its family (``DecoderAdapter.remove_layers_``:
layers renumbered, ``num_hidden_layers`` and ``layer_types`` updated), so it generates with a KV cache
and saves and reloads like any other. What it no longer shows is what was removed; activated-parameter
ratios are relative to the dense model (MoRE Eq. 16), so every removed layer's attention and MLP
projection counts are appended to ``config.moeify["removed_layers"]`` (the block the native format
saves; ``moe.accounting`` reads it). ``index`` is the layer's position in the model it was removed from.
"""

from __future__ import annotations

from torch import nn

from moeify.arch import DecoderAdapter
from moeify.files import MOEIFY_KEY
from moeify.moe.accounting import layer_mlp_counts, removed_layers


def remove_layers(model: nn.Module, indices: list[int]) -> list[dict[str, int]]:
    """Delete the decoder layers ``indices`` of ``model`` in place; returns their records."""
    adapter = DecoderAdapter(model)
    entries = [{"index": i, "attention_params": adapter.attention_params(i),
                "mlp_params": int(layer_mlp_counts(adapter, i, measured=False)[0])} for i in sorted(set(indices))]
    adapter.remove_layers_(indices)
    block = dict(getattr(model.config, MOEIFY_KEY, None) or {})
    block["removed_layers"] = removed_layers(model) + entries
    setattr(model.config, MOEIFY_KEY, block)
    return entries
