"""DSMoE: Matrix-Partitioned Experts with Dynamic Routing for Computation-Efficient Dense LLMs
(Lv et al., 2025).

1. FFN partitioning (§4.1, Eq. 6): each MLP's hidden neurons are cut into ``num_experts`` contiguous
   blocks (sizes differing by at most one when d_h is not a multiple, larger first: 172 into 8 gives
   4 x 22 + 4 x 21); no shared part. The sum of every expert's output is the dense MLP exactly.
2. Gates (Eq. 7-8): g = sigma(x Y), Y in R^{d x n}; expert i contributes when its gate passes tau, with
   weight (n / |A|) * g_i / sigma(0), |A| the token's number of active experts (``ThresholdRouter``).
   Three choices the paper leaves open, made so that the conversion is exact before training:
   - Y = 0 at conversion, so g = 1/2 for every token and expert.
   - The gate value enters relative to an untrained gate (divided by sigma(0) = 1/2): Eq. 7's
     "o_i * G(g_i)" alone would halve the MLP with every expert on. With every gate passing, |A| = n
     and every weight is 2 * 1/2 = 1: the dense model (tested on every family at tau = 0).
   - A gate passes when g >= tau (the paper: g > tau). They differ only at g = tau exactly, i.e. for
     untrained gates at tau = 1/2, which therefore pass: the untrained model at the default tau is the
     dense model too, and training starts from it (``dsmoe_train``).
   A token none of whose gates passes tau gets no expert: the layer's output for it is the MLP's output
   bias alone (zero in bias-free families, so its residual stream passes on unchanged), and it counts as
   zero activated experts. Eq. 8 would divide by zero; skipping the FFN is what "propagated only when
   the gate exceeds tau" says.
3. Continued training (§4.2-4.3, ``dsmoe_train``): straight-through estimator, LM + sparsity loss, and
   the ablations ``no_ste`` (§6.1) and ``no_gate`` (§6.2) as ``variant``.
4. Inference: ``MoeMLP`` runs only the experts whose gates pass tau, per token; ``tau`` is a runtime
   option (``moeify eval DIR --set tau=0.6``).
5. Analyses (``dsmoe_analysis``): perplexity and activated-parameter ratio for tau in 0.2..0.8
   (Appendix A, Table 4) and the activated experts per layer on each evaluation file (Fig. 3, PNG).

Defaults, for the scale of the embedded stories260K (5 layers, d = 64, d_h = 172) and its 28.8k-token
training text; the paper trains 1B-7B models on 10B tokens with AdamW, lr 2e-5, batch 32 x 1024 tokens.
Here: 200 steps of 8 x 256 tokens (410k tokens, about 14 passes over the text, minutes on a CPU), lr
2e-4 for the weights (10x the paper's: a run of 410k tokens needs larger steps than one of 10B),
1e-2 for the gates (they start at zero and must become decisive within the
run), sparsity weight 1 (Eq. 19). Every effective option is recorded with the run; the measured effect
is in ``benchmarks/bench_dsmoe.py`` and the README.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedConfig

from moeify.calibration.data import TextSource
from moeify.methods.base import ConversionContext, Method
from moeify.methods.options import OptionError, option, require_at_most, require_work_dir_for_resume
from moeify.moe.build import moe_from_partition
from moeify.moe.partition import ExpertPartition, even_sizes
from moeify.runtime.moe import ThresholdRouter


@dataclass(frozen=True)
class DsmoeConfig:
    num_experts: int = option(8, "n: experts per MLP, contiguous neuron blocks (Eq. 6)", low=2)
    tau: float = option(0.5, "gate threshold (Eq. 7); also a runtime option of the converted model", low=0.0,
                        high=1.0)
    variant: Literal["full", "no_ste", "no_gate"] = option(
        "full", "full: STE (Eq. 11); no_ste: Eq. 7 (§6.1); no_gate: Eq. 20, threshold at inference only (§6.2)")
    steps: int = option(200, "continued-training optimizer steps (0: untrained, the dense model at tau <= 0.5)", low=0)
    lr: float = option(2e-4, "AdamW learning rate of the model's weights", low=0.0, low_open=True)
    gate_lr: float = option(1e-2, "AdamW learning rate of the gates Y", low=0.0, low_open=True)
    batch_size: int = option(8, "sequences per optimizer step", low=1)
    grad_accum: int = option(1, "micro-batches per step (batch_size must be a multiple)", low=1)
    seq_len: int | None = option(None, "training window (default: min(256, model context))", low=2)
    sparsity_weight: float = option(1.0, "weight of the sparsity loss (1 in Eq. 17-19)", low=0.0)
    gate_init_std: float = option(0.0, "std of a random gate init when training starts (0: Y = 0, all on)", low=0.0)
    checkpoint_every: int = option(100, "steps between checkpoints in the work folder (0: at the end only)",
                                   low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")
    analyses: bool = option(True, "tau sweep (Table 4) and per-layer activation heatmap (Fig. 3)")

    def __post_init__(self) -> None:
        if self.batch_size % self.grad_accum:
            raise OptionError(f"batch_size={self.batch_size} must be a multiple of grad_accum={self.grad_accum}")

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("num_experts", self.num_experts, model_config.intermediate_size, "the MLP width d_h")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(256, model_config.max_position_embeddings)


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
        router = ThresholdRouter(mlp.hidden_size, cfg.num_experts, tau=cfg.tau)
        adapter.replace_mlp_(i, moe_from_partition(mlp, partition, router).to(mlp.up.device))
        sizes.append([e.numel() for e in partition.experts])
    return sizes


def convert(ctx: ConversionContext, cfg: DsmoeConfig) -> dict[str, Any]:
    require_work_dir_for_resume(cfg.resume, ctx.work_dir)
    seq_len = cfg.effective_seq_len(ctx.model.config)
    details: dict[str, Any] = {"expert_sizes": partition_model_(ctx, cfg), "train_seq_len": seq_len}
    if cfg.steps:
        from moeify.methods.dsmoe_train import continue_training

        details["training"] = continue_training(ctx, cfg, seq_len)
    return details


def analyze(ctx: ConversionContext, cfg: DsmoeConfig, sources: list[TextSource], seq_len: int) -> dict[str, Any]:
    from moeify.methods.dsmoe_analysis import analyze as run

    return run(ctx, cfg, sources, seq_len) if cfg.analyses else {}


DSMOE = Method(
    name="dsmoe",
    paper="Lv et al., DSMoE: Matrix-Partitioned Experts with Dynamic Routing for Computation-Efficient "
          "Dense LLMs, EMNLP 2025 (arXiv:2502.12455)",
    summary="contiguous FFN blocks, sigmoid-threshold gates trained with STE + sparsity loss; tau at run time",
    config_cls=DsmoeConfig,
    convert=convert,
    analyze=analyze,
)
