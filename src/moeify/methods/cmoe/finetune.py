"""CMoE's optional light fine-tuning (§V): LoRA (rank 8, alpha 32) on every linear projection except the
LM head and the routers, the score scale u at its own learning rate, Adam with betas (0.9, 0.95), and
the aux-loss-free load-balancing bias b moved by gamma after every step (Eq. 33). The LoRA weights are
merged afterwards, so the saved model has the plain MoE structure."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeify.calibration.data import token_stream
from moeify.methods.base import ConversionContext
from moeify.methods.cmoe.config import CmoeConfig
from moeify.moe.accounting import moe_layers, tracking_routing
from moeify.training.loop import TrainPlan, train


def _lora_targets(model: nn.Module) -> list[str]:
    """Full names of the linear layers LoRA wraps: all but the LM head and the routers' neurons."""
    head = model.get_output_embeddings()
    routers = {id(m) for layer in moe_layers(model) for m in layer.router.modules()}
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and id(m) not in routers]


def finetune(ctx: ConversionContext, cfg: CmoeConfig, seq_len: int) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    model = ctx.model
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      target_modules=_lora_targets(model))
    peft_model = get_peft_model(model, lora)
    layers = moe_layers(model)
    scales = [layer.router.u for layer in layers]
    for u in scales:  # peft freezes every base parameter; u must learn (Eq. 28)
        u.requires_grad_(True)
    lora_params = [p for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" in n]
    optimizer = torch.optim.Adam([{"params": lora_params, "lr": cfg.lr}, {"params": scales, "lr": cfg.u_lr}],
                                 betas=(0.9, 0.95))
    stream = token_stream(ctx.calib, ctx.tokenizer)

    def balance() -> None:  # Eq. 33, from the tokens each expert received in this step
        for layer in layers:
            layer.router.update_bias(layer.stats_expert_tokens)
            layer.reset_stats()

    plan = TrainPlan(steps=cfg.finetune_steps, batch_size=cfg.finetune_batch_size, seq_len=seq_len,
                     grad_accum=cfg.grad_accum, recompute=cfg.recompute)
    # The token counts per expert that ``balance`` reads (a recomputed layer counts its tokens twice: the
    # sign of load - mean, all Eq. 33 uses, does not change).
    with tracking_routing(model):
        log = train(peft_model, optimizer, stream, plan, seed=ctx.seed + 1, device=ctx.device, after_step=balance,
                    progress=ctx.progress, desc="cmoe: fine-tuning", network=model)
    ctx.model = peft_model.merge_and_unload()  # LoRA folded into the weights; plain MoE structure again
    for u in scales:
        u.requires_grad_(False)
    return {**log.summary(), "u_abs_mean": float(torch.cat([u.detach().abs() for u in scales]).mean())}
