"""Dense2MoE: Unifying Pruning and Upcycling for Efficient Large Language Models (anonymous, under review).

1. Inter-layer similarity (§2.2, Eq. 4-5; ``calibration.similarity``): S_L, the mean per-token cosine of
   decoder-layer outputs x^(l), and S_M, that of MLP inputs h^(l), for every pair of layers, streamed one
   decoder layer at a time; both matrices go to the record and, as heatmaps (Fig. 3), next to the model.
2. Selection (§2.3): spans (l, n) in descending S_L order; the first whose fused MLPs would read inputs
   close enough to h^(l) is taken as (l*, n*). The paper writes the condition s(h^(l), h^(l+n)) < delta
   while calling these inputs similar, and introduces it as a distance d(h^(l), h^(l+n)); we read it as
   that distance, d = 1 - s < delta, and require it of every fused layer (k = 1 .. n*: each of their
   MLPs will be fed h^(l*)), not only of the last. ``prune_layers`` (k of §4.1) restricts the search to
   n = k, so a number of layers can be asked for directly; ``none`` searches every span, which in
   practice takes the most similar adjacent pair. delta = 0.3 (the paper gives no value) lets adjacent
   layers of stories260K qualify (distances 0.12-0.15) and spans of two (0.25-0.29).
3. Pruning and Layer-Fusion Upcycling (Eq. 6): layers l*+1 .. l*+n* are removed entirely, not only their
   attention: §2 "retain the first layer ..., drop all subsequent layers, and retain their MLPs in the
   first layer as experts", and Eq. 6 goes from x^(l*-1) to x^(l*+n*) through MHA^(l*) alone. Their
   MLPs live on as experts of layer l*'s MoE: N (``num_copies``) copies of l*'s MLP and M
   (``copies_per_pruned``) copies of each removed layer's, all reading h^(l*) (through l*'s MLP norm).
   The model stays a plain, shorter model of its family (``moe.depth``): generation with a KV cache,
   saving and both loading paths need nothing special, and the accounting keeps the dense total.
   Choices the paper leaves open:
   - the paper's MLP^(l) reads the pre-norm h (Eq. 3), so it includes its own norm: each removed
     layer's norm weight is folded into its experts' input projections (``fold_mlp_norm``, exact), so
     that expert computes MLP^(l*+k)(h^(l*)) as Eq. 6 writes it;
   - the router is the softmax top-k of §2.1 with weights p_i * E / k (``SoftmaxTopKRouter``: an
     untrained router's weights sum to 1), reading the normed MLP input as every Hugging Face MoE does;
     W_g ~ N(0, initializer_range^2) from the seed, so identical copies get different tokens from the
     first step and training breaks their symmetry;
   - what these choices do at top-1 with one removed layer on stories260K (held-out perplexity after
     the default budget, seed 0, unless noted): the router ends sending 95-99.7 % of tokens to the kept
     MLP and ``lfuc`` beats the baselines by about 1 % (8.83 against 8.94 / 8.93). At top-1 one MLP
     replaces the other for a token; on the calibration tokens the removed layer's MLP restores the
     dense layers' residual update better than the kept one for 38 % of tokens, but only by little: the
     squared error of always taking the kept MLP is 11.60, of the per-token best 10.38, of the best
     linear router (73 % of choices right) 11.49, of running both (top-2) 8.20. The alternatives tried
     do not change that: W_g = 0 (every token ties to the kept MLP, the fused one never gets a token:
     ``lfuc`` becomes ``prune_upcycle`` exactly, 7.849 both at lr 3e-4), W_g fitted to that per-token
     best choice (untrained perplexity 11.38 against 12.15 with the random router and 10.80 for
     ``prune_only``), the removed MLP reading l*'s normed input without folding its own norm (8.85), the
     paper's weight p_i without E / k (worse for both MoE variants: ``lfuc`` 8.90, ``prune_upcycle`` 9.06).
     The learning rate decides the order (``dense2moe_train``); top-2 is decisive (8.07 against 8.93);
   - an output bias (GPT-NeoX, Phi) cannot be routed per expert in ``ExpertMLP``: the layer keeps l*'s,
     added once; the removed layers' output biases are dropped (the fine-tuning re-learns the offset).
   Activated parameters count the top-k experts (each a whole MLP) and no attention for the removed
   layers, against the dense model's total: replicated experts add parameters, not compute savings per
   se; the savings are the removed attention and, for k < number of fused MLPs, the MLPs not run.
4. Fine-tuning (§3.1, ``dense2moe_train``): every parameter, LM loss, warm-up then cosine decay. The
   defaults are a budget for a 2-core CPU on stories260K (``benchmarks/bench_dense2moe.py``); the
   training text is the calibration text.
5. ``variant`` (Table 5 and its baselines): ``lfuc`` (the method), ``prune_upcycle`` (the same removal,
   the MoE built from N + n* M copies of l*'s MLP alone) and ``prune_only`` (ShortGPT-style removal of
   the same layers, no MoE); the fine-tuning is the same for all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedConfig

from moeify.calibration.data import calibration_batches
from moeify.calibration.similarity import layer_similarity, similarity_heatmaps
from moeify.methods.base import ConversionContext, Method
from moeify.methods.dense2moe_build import expert_sources, fuse_layers_, rank_spans, select_span
from moeify.methods.options import OptionError, option, require_at_most, require_work_dir_for_resume


@dataclass(frozen=True)
class Dense2moeConfig:
    variant: Literal["lfuc", "prune_upcycle", "prune_only"] = option(
        "lfuc", "lfuc: Layer-Fusion Upcycling; prune_upcycle / prune_only: Table 5's baselines")
    prune_layers: int | None = option(1, "k = n*: layers to remove after l* (none: search every span)", low=1)
    delta: float = option(0.3, "fuse only MLP inputs at cosine distance 1 - s(h^(l*), h^(l*+k)) < delta",
                          low=0.0, high=2.0, low_open=True)
    num_copies: int = option(1, "N: copies of layer l*'s MLP among the experts", low=1)
    copies_per_pruned: int = option(1, "M: copies of each removed layer's MLP among the experts", low=1)
    top_k: int = option(1, "experts per token (§2.1; the paper uses top-1)", low=1)
    calib_samples: int = option(8, "calibration windows (of seq_len tokens) for the similarity", low=1)
    steps: int = option(100, "fine-tuning optimizer steps (0: none)", low=0)
    lr: float = option(1e-3, "peak learning rate (AdamW, every parameter)", low=0.0, low_open=True)
    warmup: int = option(10, "linear warm-up steps, then cosine decay to lr / 10 (§3.1)", low=0)
    seq_len: int | None = option(None, "training and calibration window (default: min(1024, context))", low=2)
    batch_size: int = option(4, "sequences per optimizer step", low=1)
    checkpoint_every: int = option(50, "steps between checkpoints in the work folder (0: at the end only)", low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")

    def __post_init__(self) -> None:
        if self.warmup > self.steps:
            raise OptionError(f"warmup={self.warmup} must be <= steps={self.steps}")
        experts = self.num_copies + self.copies_per_pruned * (self.prune_layers or 1)
        if self.variant != "prune_only" and self.top_k > experts:
            raise OptionError(f"top_k={self.top_k} must be <= the experts num_copies + copies_per_pruned x "
                              f"prune_layers = {experts}")

    def check(self, model_config: PreTrainedConfig) -> None:
        layers = model_config.num_hidden_layers
        if layers < 2:
            raise OptionError(f"dense2moe needs at least 2 decoder layers; the model has {layers}")
        require_at_most("prune_layers", self.prune_layers, layers - 1, "the layers after the first one")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(1024, model_config.max_position_embeddings)


def convert(ctx: ConversionContext, cfg: Dense2moeConfig) -> dict[str, Any]:
    require_work_dir_for_resume(cfg.resume, ctx.work_dir)
    seq_len = cfg.effective_seq_len(ctx.model.config)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    similarity = layer_similarity(ctx.model, batches, device=ctx.device, progress=ctx.progress)
    ctx.artifacts.update(similarity_heatmaps(similarity))
    span = select_span(similarity.layer_output, similarity.mlp_input, cfg.delta, cfg.prune_layers)
    sources = expert_sources(span, cfg.variant, cfg.num_copies, cfg.copies_per_pruned)
    removed = fuse_layers_(ctx.model, span, sources, cfg.top_k, ctx.seed)
    details: dict[str, Any] = {
        "calibration": {"samples": cfg.calib_samples, "seq_len": seq_len, "tokens": similarity.tokens},
        "similarity": similarity.as_dict(), "selection": span.as_dict(),
        "candidates": [s.as_dict() for s in rank_spans(similarity.layer_output, similarity.mlp_input,
                                                        cfg.prune_layers)],
        "expert_sources": sources, "removed_layers": removed, "train_seq_len": seq_len}
    if cfg.steps:
        from moeify.methods.dense2moe_train import finetune

        details["finetune"] = finetune(ctx, cfg, seq_len)
    return details


DENSE2MOE = Method(
    name="dense2moe",
    paper="Dense2MoE: Unifying Pruning and Upcycling for Efficient Large Language Models (anonymous, under "
          "review)",
    summary="remove redundant layers (similarity of layer outputs / MLP inputs), fuse their MLPs as experts "
            "of the kept layer (softmax top-k), fine-tune",
    config_cls=Dense2moeConfig,
    convert=convert,
)
