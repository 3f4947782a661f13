"""CMoE's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from moeify.methods.cmoe.config import CarvingOptions
from moeify.moe.experts.refit_options import refit_bytes
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: CarvingOptions, nbytes: int) -> MethodMemory:
    """Per layer: the MLP inputs X of every calibration token (captured, then concatenated), ATopK's float32
    unit-norm weights and hidden activations (gate, up, product) with the markers A (Eq. 5-6), and with
    ``refit_down`` the least-squares fit's own."""
    q = cfg.calib_samples * cfg.effective_seq_len(shape.config)
    d, m = shape.hidden, shape.intermediate
    refit = refit_bytes(q, d, m) if cfg.refit_down else 0
    return method_memory(shape, cfg, nbytes, layer_statistics=2 * q * d * nbytes + 3 * q * m * 4 + q * m
                         + 3 * m * d * 4 + refit)
