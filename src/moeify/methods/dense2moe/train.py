"""Dense2MoE's fine-tuning (§3.1): continual pre-training of every parameter of the pruned and fused
model with the LM loss, through the shared loop (``moeify.training.loop``): AdamW (torch's defaults;
the paper names no optimizer), a linear warm-up from 0 to ``lr`` over ``warmup`` steps, then a cosine
decay to lr / 10 at the last step (the paper's 1e-4 -> 1e-5), random windows of the training text.
No load-balancing loss: the paper names none, and on stories260K (top-1, one removed layer) a
Switch-style auxiliary loss of weight 0.1 kept the fused expert in use but raised the held-out
perplexity of ``lfuc`` by a couple of percent (200 steps at lr 1e-4).

The peak learning rate is the one choice that decides Table 5's order at top-1 on stories260K (one
removed layer, 100 steps of 4 x 512 tokens, about 7 passes over the 28.8k-token training slice;
held-out perplexity, seeds 0/1/2, ``benchmarks/bench_dense2moe.py``): at the default 1e-3 ``lfuc`` is
lowest in every seed, by at most about a percent; at 3e-4 every variant ends lower and the three tie
within a percent; at the paper's 1e-4 ``lfuc`` is last, by a few percent (seed 0): its random router
sends a third of the tokens to the removed layer's MLP in place of the kept one at first (untrained, it
scores well above both baselines), and a small rate does not undo that in 100 steps. 1e-3 stays the
default."""

from __future__ import annotations

from typing import Any

import torch

from moeify.calibration.data import token_stream
from moeify.methods.base import ConversionContext
from moeify.methods.dense2moe.config import Dense2moeConfig
from moeify.training.loop import TrainPlan, WarmupCosine, train

FINAL_LR_RATIO = 0.1  # §3.1: cosine decay from 1e-4 to 1e-5


def finetune(ctx: ConversionContext, cfg: Dense2moeConfig, seq_len: int) -> dict[str, Any]:
    """Train ``ctx.model`` in place; returns the training log summary."""
    optimizer = torch.optim.AdamW(ctx.model.parameters(), lr=cfg.lr)
    plan = TrainPlan(steps=cfg.steps, batch_size=cfg.batch_size, seq_len=seq_len, grad_accum=cfg.grad_accum,
                     checkpoint_every=cfg.checkpoint_every, schedule=WarmupCosine(cfg.warmup, FINAL_LR_RATIO),
                     recompute=cfg.recompute)
    # steps may not change on resume: the learning-rate schedule depends on it
    checkpointing = ctx.checkpointing("dense2moe", cfg, seq_len, free=("recompute", "grad_accum"))
    log = train(ctx.model, optimizer, token_stream(ctx.calib, ctx.tokenizer), plan, seed=ctx.seed + 1,
                device=ctx.device, checkpointing=checkpointing, progress=ctx.progress,
                desc=f"dense2moe ({cfg.variant}): fine-tuning")
    return {**log.summary(), "final_lr_ratio": FINAL_LR_RATIO,
            "checkpoints": None if checkpointing is None else str(checkpointing.folder)}
