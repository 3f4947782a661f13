"""TEAL's part of ``moeify plan``'s estimate (``moeify.planning``): what its calibration holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from moeify.methods.teal.config import AttentionSparsityOptions, TealConfig
from moeify.planning import MethodMemory, ModelShape, method_memory

QUANTILE_LIMIT = 2 ** 24  # torch.quantile's input size limit


def memory(shape: ModelShape, cfg: TealConfig, nbytes: int) -> MethodMemory:
    """Per decoder layer: every projection's float32 inputs over all calibration tokens (one tensor per
    distinct input: q/k/v's, o's, the MLP's, and down's, d_ff wide), then the threshold of the widest."""
    samples, seq_len = cfg.calibration_windows(shape.config)
    tokens = samples * seq_len
    captured = tokens * (3 * shape.hidden + shape.intermediate) * 4
    return method_memory(shape, cfg, nbytes, layer_statistics=captured + _quantile(tokens * shape.intermediate))


def attention_memory(shape: ModelShape, options: AttentionSparsityOptions) -> MethodMemory:
    """The attention thresholds' calibration (``attention_sparsity``), per decoder layer: the float32 inputs of
    q/k/v and of o over TEAL's windows, hidden-wide, then the threshold of one of them."""
    samples, seq_len = options.calibration().calibration_windows(shape.config)
    tokens = samples * seq_len
    return MethodMemory(calib_tokens=tokens, layer_statistics=2 * tokens * shape.hidden * 4
                        + _quantile(tokens * shape.hidden))


def _quantile(entries: int) -> int:
    """The threshold of ``entries`` inputs: their magnitudes (a copy per captured batch, then their
    concatenation), and torch.quantile's contiguous and sorted copies of at most ``QUANTILE_LIMIT`` of them
    with their int64 order."""
    return max(2 * entries * 4, entries * 4 + min(entries, QUANTILE_LIMIT) * (4 + 4 + 8))
