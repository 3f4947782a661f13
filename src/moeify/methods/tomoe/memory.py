"""ToMoE's part of ``moeify plan``'s estimate (``moeify.planning``): what its conversion holds beyond the
common phases, from the model's shape and the options alone (no torch)."""

from __future__ import annotations

from moeify.methods.tomoe.config import EMBED_DIM, TomoeConfig
from moeify.planning import MethodMemory, ModelShape, method_memory


def memory(shape: ModelShape, cfg: TomoeConfig, nbytes: int) -> MethodMemory:
    """The weights stay frozen: what trains is Theta (per layer Proj_D^MLP's 128 x d_mid and the d x N
    router; the hypernetwork and attention projections are smaller), and the masked MLPs keep their
    (tokens, d_mid) masks and masked activations for the backward pass; the loss is a distillation KL. With
    ``frozen_weights=float32`` a low-precision model is held in float32 while Theta trains. The converted
    experts overlap: their packed inference copy holds N experts of about p d_mid neurons each."""
    trainable = shape.layers * (EMBED_DIM * shape.intermediate + shape.hidden * cfg.num_experts)
    return method_memory(shape, cfg, nbytes, trainable=trainable, extra_train_activations=2 * shape.intermediate * 4,
                         distillation=True, frozen_in_float32=cfg.frozen_weights == "float32",
                         packed_share=cfg.num_experts * cfg.active_ratio)
