"""DSMoE's options: experts, the gate threshold tau, the ablation variant, continued training and analyses."""

from __future__ import annotations

from typing import Literal

from transformers import PreTrainedConfig

from moeify.options import method_config, option, require_at_most, require_multiple
from moeify.runtime.routers import NEUTRAL_GATE_SCALE


@method_config
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
    gate_weighting: Literal["auto", "paper", "neutral"] = option(
        "auto", "expert weight g n/|A| as Eq. 7-8 (paper) or 2 g n/|A| so that an untrained gate weighs 1 "
                "(neutral); auto: paper with a random gate init, neutral from Y = 0")
    checkpoint_every: int = option(100, "steps between checkpoints in the work folder (0: at the end only)",
                                   low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")
    recompute: bool = option(True, "activation checkpointing while training: each decoder layer's activations are "
                                   "recomputed in the backward pass (far less memory, about 1/3 more compute)")
    analyses: bool = option(True, "tau sweep (Table 4) and per-layer activation heatmap (Fig. 3)")

    def validate(self) -> None:
        require_multiple("batch_size", self.batch_size, "grad_accum", self.grad_accum)

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("num_experts", self.num_experts, model_config.intermediate_size, "the MLP width d_h")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(256, model_config.max_position_embeddings)


def gate_scale(cfg: DsmoeConfig) -> float:
    """The layers' gate scale: 1 for Eq. 7-8 exactly, 1 / sigma(0) for neutral untrained gates."""
    weighting = cfg.gate_weighting
    if weighting == "auto":
        weighting = "paper" if cfg.gate_init_std > 0 else "neutral"
    return 1.0 if weighting == "paper" else NEUTRAL_GATE_SCALE
