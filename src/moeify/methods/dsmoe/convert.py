"""DSMoE's conversion: contiguous expert blocks with untrained sigmoid gates, then continued training
(see the package docstring)."""

from __future__ import annotations

from typing import Any

import torch

from moeify.calibration.data import TextSource, calibration_batches
from moeify.methods.base import Analysis, Conversion, ConversionContext
from moeify.methods.dsmoe.config import DsmoeConfig, gate_scale
from moeify.moe.accounting import attention_share
from moeify.moe.experts.build import moe_from_partition
from moeify.moe.experts.partition import ExpertPartition, even_sizes
from moeify.options import OptionError, require_work_dir_for_resume
from moeify.runtime.routers import ThresholdRouter


def contiguous_partition(intermediate_size: int, num_experts: int) -> ExpertPartition:
    """Eq. 6: neurons [0, s_0), [s_0, s_0 + s_1), ... as experts, no shared part."""
    blocks = torch.arange(intermediate_size).split(even_sizes(intermediate_size, num_experts))
    return ExpertPartition(shared=torch.zeros(0, dtype=torch.long), experts=tuple(blocks))


def partition_model_(ctx: ConversionContext, cfg: DsmoeConfig) -> list[list[int]]:
    """Replace every MLP by its DSMoE layer with untrained gates; returns the expert sizes per layer."""
    adapter = ctx.adapter
    sizes = []
    for i in range(adapter.num_layers):
        mlp = adapter.mlp(i)
        partition = contiguous_partition(mlp.intermediate_size, cfg.num_experts)
        router = ThresholdRouter(mlp.hidden_size, cfg.num_experts, tau=cfg.tau, gate_scale=gate_scale(cfg))
        adapter.replace_mlp_(i, moe_from_partition(mlp, partition, router).to(mlp.up.device))
        sizes.append([e.numel() for e in partition.experts])
    return sizes



def convert(ctx: ConversionContext, cfg: DsmoeConfig) -> Conversion:
    require_work_dir_for_resume(cfg.resume, ctx.work_dir)
    if cfg.active_ratio is not None and cfg.active_ratio <= (floor := attention_share(ctx.adapter)):
        raise OptionError(f"active_ratio={cfg.active_ratio} is out of range; allowed: ({floor:.3f}, 1] (the "
                          "attention's share of the model: no gate passing leaves it)")
    seq_len = cfg.effective_seq_len(ctx.model.config)
    details: dict[str, Any] = {"expert_sizes": partition_model_(ctx, cfg), "train_seq_len": seq_len}
    if cfg.steps:
        from moeify.methods.dsmoe.train import continue_training

        details["training"] = continue_training(ctx, cfg, seq_len)
    if cfg.active_ratio is not None:
        details["matched_tau"] = refit(ctx, cfg)
    return Conversion(ctx.model, details)


def refit(ctx: ConversionContext, cfg: DsmoeConfig) -> dict[str, Any] | None:
    """With ``active_ratio``, the tau of every layer at which the model's APR on training-text windows is the
    target (``budget.match_tau_``): after the training, and again after a recovery, whose weight updates move
    the gates' scores; None without it (the trained tau is the paper's and stays)."""
    if cfg.active_ratio is None:
        return None
    from moeify.methods.dsmoe.budget import match_tau_

    windows = calibration_batches(ctx.calib, ctx.tokenizer, cfg.batch_size, cfg.effective_seq_len(ctx.model.config),
                                  ctx.seed)
    return match_tau_(ctx.model, windows, cfg.active_ratio)


def analyze(ctx: ConversionContext, cfg: DsmoeConfig, sources: list[TextSource], seq_len: int) -> Analysis:
    from moeify.methods.dsmoe.analysis import analyze as run

    return run(ctx, cfg, sources, seq_len) if cfg.analyses else Analysis({})
