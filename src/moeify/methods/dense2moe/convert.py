"""Dense2MoE's conversion: similarity, span selection, layer-fusion upcycling, fine-tuning (see the
package docstring)."""

from __future__ import annotations

from typing import Any

from moeify.calibration.data import calibration_batches
from moeify.calibration.similarity import layer_similarity, similarity_heatmaps
from moeify.methods.base import Conversion, ConversionContext
from moeify.methods.dense2moe.build import expert_sources, fuse_layers_, rank_spans, select_span, select_spans
from moeify.methods.dense2moe.config import Dense2moeConfig, span_sizes
from moeify.options import require_work_dir_for_resume


def convert(ctx: ConversionContext, cfg: Dense2moeConfig) -> Conversion:
    require_work_dir_for_resume(cfg.resume, ctx.work_dir)
    seq_len = cfg.effective_seq_len(ctx.model.config)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    similarity = layer_similarity(ctx.model, batches, device=ctx.device, progress=ctx.progress)
    if cfg.search:  # §2.3: (l*, n*) the first span in S_L order that qualifies, whatever its length
        spans = [select_span(similarity.layer_output, similarity.mlp_input, cfg.delta, None)]
        sizes = [spans[0].n]
    else:
        sizes = span_sizes(cfg.layers_to_prune(ctx.model.config), cfg.spans)
        spans = select_spans(similarity.layer_output, similarity.mlp_input, cfg.delta, sizes)
    sources = [expert_sources(span, cfg.variant, cfg.num_copies, cfg.copies_per_pruned) for span in spans]
    removed = fuse_layers_(ctx.model, spans, sources, cfg.top_k, ctx.seed, cfg.router_weighting == "paper")
    details: dict[str, Any] = {
        "calibration": {"samples": cfg.calib_samples, "seq_len": seq_len, "tokens": similarity.tokens},
        "similarity": similarity.as_dict(), "selection": [span.as_dict() for span in spans],
        "candidates": [s.as_dict() for size in sorted(set(sizes))
                       for s in rank_spans(similarity.layer_output, similarity.mlp_input, size)],
        "expert_sources": sources, "removed_layers": removed, "train_seq_len": seq_len}
    if cfg.steps:
        from moeify.methods.dense2moe.train import finetune

        details["finetune"] = finetune(ctx, cfg, seq_len)
    return Conversion(ctx.model, details, similarity_heatmaps(similarity))
