"""Dense2MoE's fine-tuning (§3.1): continual pre-training of every parameter of the pruned and fused
model with the LM loss, through the shared loop (``moeify.training.loop``): AdamW (torch's defaults;
the paper names no optimizer), a linear warm-up from 0 to ``lr`` over ``warmup`` steps, then a cosine
decay to lr / 10 at the last step (the paper's 1e-4 -> 1e-5), random windows of the training text.
No load-balancing loss: the paper names none, and in a development trial on stories260K (top-1, one
removed layer) a Switch-style auxiliary loss of weight 0.1 kept the fused expert in use but raised the
held-out perplexity of ``lfuc`` (7.50 against 7.37 without, 200 steps at lr 1e-4)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moeify.calibration.data import token_stream
from moeify.training.loop import Checkpointing, TrainPlan, WarmupCosine, train

if TYPE_CHECKING:
    from moeify.methods.base import ConversionContext
    from moeify.methods.dense2moe import Dense2moeConfig

FINAL_LR_RATIO = 0.1  # §3.1: cosine decay from 1e-4 to 1e-5


def _fingerprint(ctx: ConversionContext, cfg: Dense2moeConfig, seq_len: int) -> dict[str, Any]:
    """What a resumed run must share with the checkpointed one: every option but ``resume`` and
    ``checkpoint_every`` (``steps`` too: the learning-rate schedule depends on it)."""
    keep = {k: v for k, v in vars(cfg).items() if k not in ("resume", "checkpoint_every")}
    return {"method": "dense2moe", **keep, "seq_len": seq_len, "seed": ctx.seed,
            "model": str(ctx.model.config.name_or_path), "train_text_sha256": ctx.calib.sha256}


def finetune(ctx: ConversionContext, cfg: Dense2moeConfig, seq_len: int) -> dict[str, Any]:
    """Train ``ctx.model`` in place; returns the training log summary."""
    optimizer = torch.optim.AdamW(ctx.model.parameters(), lr=cfg.lr)
    plan = TrainPlan(steps=cfg.steps, batch_size=cfg.batch_size, seq_len=seq_len,
                     checkpoint_every=cfg.checkpoint_every, schedule=WarmupCosine(cfg.warmup, FINAL_LR_RATIO))
    checkpointing = None if ctx.work_dir is None else Checkpointing(
        ctx.work_dir / "dense2moe_checkpoints", _fingerprint(ctx, cfg, seq_len), resume=cfg.resume)
    log = train(ctx.model, optimizer, token_stream(ctx.calib, ctx.tokenizer), plan, seed=ctx.seed + 1,
                device=ctx.device, checkpointing=checkpointing, progress=ctx.progress,
                desc=f"dense2moe ({cfg.variant}): fine-tuning")
    return {**log.summary(), "final_lr_ratio": FINAL_LR_RATIO,
            "checkpoints": None if checkpointing is None else str(checkpointing.folder)}
