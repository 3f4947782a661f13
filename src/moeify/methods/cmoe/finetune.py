"""CMoE's optional light fine-tuning (§V): LoRA (rank 8, alpha 32) on every linear projection except the
LM head and the routers, the score scale u at its own learning rate, Adam with betas (0.9, 0.95), and
the aux-loss-free load-balancing bias b moved by gamma after every step (Eq. 33). The paper makes one
pass over 2,048 samples (``finetune_samples``); ``finetune_steps`` draws random windows instead. The
LoRA weights are merged afterwards, so the saved model has the plain MoE structure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moeify.calibration.data import token_stream
from moeify.methods.base import ConversionContext
from moeify.methods.cmoe.config import CarvingOptions
from moeify.moe.accounting import moe_layers, tracking_routing
from moeify.training.distributed import all_reduce_sum_
from moeify.training.lora import lora_finetune

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def finetune(ctx: ConversionContext, cfg: CarvingOptions, seq_len: int) -> tuple[PreTrainedModel, dict[str, Any]]:
    """LoRA on the experts and the score scales u, with Eq. 33's load balancing after every step: the model
    with LoRA merged, and the log."""
    layers = moe_layers(ctx.model)
    scales = [layer.router.u for layer in layers]

    def balance() -> None:  # Eq. 33, from the tokens each expert received in this step (in every process)
        all_reduce_sum_(layer.stats_expert_tokens for layer in layers)
        for layer in layers:
            layer.router.update_bias(layer.stats_expert_tokens)
            layer.reset_stats()

    plan = cfg.plan(seq_len)
    # The token counts per expert that ``balance`` reads (a recomputed layer counts its tokens twice: the
    # sign of load - mean, all Eq. 33 uses, does not change).
    with tracking_routing(ctx.model):
        model, log = lora_finetune(ctx.model, cfg, token_stream(ctx.calib, ctx.tokenizer), plan,
                                   seed=ctx.seed + 1, device=ctx.device, progress=ctx.progress,
                                   desc="cmoe: fine-tuning", extra=scales, extra_lr=cfg.u_lr, after_step=balance)
    return model, {**log.summary(), "seq_len": plan.seq_len, "batch_size": plan.batch_size,
                   "u_abs_mean": float(torch.cat([u.detach().abs() for u in scales]).mean())}
