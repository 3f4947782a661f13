"""TEAL's part of ``moeify plan``'s estimate (``moeify.planning``): what its calibration holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from moeify.methods.teal.config import TealConfig
from moeify.planning import MethodMemory, ModelShape, method_memory

QUANTILE_LIMIT = 2 ** 24  # torch.quantile's input size limit


def memory(shape: ModelShape, cfg: TealConfig, nbytes: int) -> MethodMemory:
    """Per decoder layer: every projection's float32 inputs over all calibration tokens (one tensor per
    distinct input: q/k/v's, o's, the MLP's, and down's, d_ff wide), then the threshold of the widest: its
    magnitudes (a copy per captured batch, then their concatenation), and torch.quantile's contiguous and
    sorted copies of at most ``QUANTILE_LIMIT`` of them with their int64 order."""
    samples, seq_len = cfg.calibration_windows(shape.config)
    tokens = samples * seq_len
    captured = tokens * (3 * shape.hidden + shape.intermediate) * 4
    widest = tokens * shape.intermediate
    quantile = max(2 * widest * 4, widest * 4 + min(widest, QUANTILE_LIMIT) * (4 + 4 + 8))
    return method_memory(shape, cfg, nbytes, layer_statistics=captured + quantile)
