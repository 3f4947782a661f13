"""Dense2MoE's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

import dataclasses

from moeify.methods.dense2moe.config import Dense2moeConfig
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: Dense2moeConfig, nbytes: int) -> MethodMemory:
    """Every parameter trains (the common estimate); before that, the layer similarity keeps the float32 unit
    vectors of every layer's output and MLP input for every calibration token (``calibration.similarity``:
    2 N T d)."""
    tokens = cfg.calib_samples * cfg.effective_seq_len(shape.config)
    units = shape.layers * tokens * shape.hidden * 4
    return dataclasses.replace(method_memory(shape, cfg, nbytes), layer_statistics=2 * units)
