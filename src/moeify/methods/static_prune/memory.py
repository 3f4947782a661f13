"""Static pruning's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond
the common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from dataclasses import replace

from moeify.methods.static_prune.config import StaticPruneConfig
from moeify.moe.experts.refit_options import refit_bytes
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: StaticPruneConfig, nbytes: int) -> MethodMemory:
    """The common estimate (one calibration window's MLP hidden activations for the channels' importance); with
    ``refit_down`` also the MLP inputs of every calibration token (captured, then concatenated) and the
    least-squares fit's own."""
    common = method_memory(shape, cfg, nbytes)
    if not cfg.refit_down:
        return common
    q, d = common.calib_tokens, shape.hidden
    refit = 2 * q * d * nbytes + refit_bytes(q, d, shape.intermediate)
    return replace(common, layer_statistics=common.layer_statistics + refit)
