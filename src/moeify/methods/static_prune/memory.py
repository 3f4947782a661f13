"""Static pruning's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond
the common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from moeify.methods.static_prune.config import StaticPruneConfig
from moeify.moe.experts.refit_options import refit_bytes
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: StaticPruneConfig, nbytes: int) -> MethodMemory:
    """Per layer: one calibration window's MLP hidden activations in float32 (gate, up, product) for the
    channels' importance; with ``refit_down`` also the MLP inputs of every calibration token (captured, then
    concatenated) and the least-squares fit's own."""
    windows, seq = cfg.calibration_windows(shape.config)
    q, d, m = windows * seq, shape.hidden, shape.intermediate
    refit = 2 * q * d * nbytes + refit_bytes(q, d, m) if cfg.refit_down else 0
    return method_memory(shape, cfg, nbytes, layer_statistics=3 * seq * m * 4 + refit)
