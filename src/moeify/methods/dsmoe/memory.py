"""DSMoE's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

import dataclasses

from moeify.methods.dsmoe.config import DsmoeConfig, fit_windows
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: DsmoeConfig, nbytes: int) -> MethodMemory:
    """Every parameter trains (the common estimate); before that, the margin start streams its fit windows
    a decoder layer at a time and keeps a float64 d x d Gram matrix per layer while it fits."""
    base = method_memory(shape, cfg, nbytes)
    if not (cfg.steps and cfg.gate_init == "margin"):
        return base
    seq_len = cfg.effective_seq_len(shape.config)
    return dataclasses.replace(base, calib_tokens=fit_windows(cfg, shape.hidden, seq_len) * seq_len,
                               layer_statistics=8 * shape.hidden ** 2)
