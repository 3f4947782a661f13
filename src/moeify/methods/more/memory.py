"""MoRE's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from moeify.methods.more.config import MoreConfig
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: MoreConfig, nbytes: int) -> MethodMemory:
    """Per converted layer: the float32 co-activation counts (m x m), then C_R in float64 and the normalised
    affinity the spectral decomposition works on in place (``moe.experts.spectral``): 4 + 2 x 8 bytes per entry at
    the peak, and one stream batch's float32 hidden activations and activation-set marks."""
    m = shape.intermediate
    batch_tokens = 8 * cfg.seq_len
    return method_memory(shape, cfg, nbytes, layer_statistics=(4 + 2 * 8) * m * m + 4 * batch_tokens * m * 4)
