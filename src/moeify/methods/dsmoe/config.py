"""DSMoE's options: experts, the gate threshold tau, the ablation variant, continued training and analyses."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from moeify.options import (
    MethodOptions,
    OptionError,
    Training,
    method_config,
    option,
    require_at_most,
    require_multiple,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter


@method_config
class DsmoeConfig(MethodOptions):
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
    gate_init: Literal["margin", "zero", "random"] = option(
        "margin", "where training starts the gates: margin: every gate on at about sigma(gate_margin), Y fit by least "
                  "squares on at least 4 d tokens of the training text; zero: Y = 0, every gate at the threshold "
                  "1/2; random: Y ~ N(0, gate_init_std^2), the paper's (§4.2)")
    gate_margin: float = option(1.0, "start logit x Y of every gate with gate_init=margin", low=0.0, low_open=True)
    gate_init_std: float = option(0.1, "std of Y with gate_init=random", low=0.0, low_open=True)
    gate_weighting: Literal["auto", "paper", "neutral"] = option(
        "auto", "expert weight g n/|A| as Eq. 7-8 (paper) or g n/|A| / g0 so that a gate at its start value g0 "
                "weighs 1 (neutral: the layer starts as the dense MLP); auto: paper with gate_init=random, else "
                "neutral")
    checkpoint_every: int = option(100, "steps between checkpoints in the work folder (0: at the end only)",
                                   low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")
    recompute: bool = option(True, "activation checkpointing while training: each decoder layer's activations are "
                                   "recomputed in the backward pass (far less memory, about 1/3 more compute)")
    active_ratio: float | None = option(
        None, "after training, set tau so that the APR measured on batch_size windows of the training text is "
              "this (bisection; the gates unchanged); above the attention's share of the model; none: tau as "
              "trained", low=0.0, high=1.0, low_open=True)
    analyses: bool = option(True, "tau sweep (Table 4) and per-layer activation heatmap (Fig. 3)")

    def validate(self) -> None:
        require_multiple("batch_size", self.batch_size, "grad_accum", self.grad_accum)
        if self.steps and self.gate_init == "margin" and sigmoid(self.gate_margin) <= self.tau:
            raise OptionError(f"gate_margin={self.gate_margin} starts the gates at sigma({self.gate_margin}) = "
                              f"{sigmoid(self.gate_margin):.3f}, not above tau={self.tau}; allowed: gate_margin > "
                              f"{logit(self.tau):.3f} (logit of tau)")

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("num_experts", self.num_experts, model_config.intermediate_size, "the MLP width d_h")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(256, model_config.max_position_embeddings)

    def training(self, model_config: PreTrainedConfig) -> Training | None:
        """The continued training of every weight and gate (none at ``steps=0``)."""
        if not self.steps:
            return None
        return Training(False, self.batch_size, self.grad_accum, self.effective_seq_len(model_config), self.recompute)


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """Trained as the paper trains it, then tau set for APR ``apr`` (``budget.match_tau_``)."""
    return [{"active_ratio": apr}], f"active_ratio={apr} (tau set after training)"


#: Tokens the margin fit sees per hidden dimension. With fewer the least-squares fit follows its own
#: tokens and not the direction MLP inputs share, and on other text some tokens start with a layer's experts
#: off (``benchmarks/bench_dsmoe_start.py`` on SmolLM2-135M, docs/results.md). A 7B model's default batch of
#: 2,048 tokens is d / 2.
FIT_TOKENS_PER_DIM = 4


def fit_windows(cfg: DsmoeConfig, hidden_size: int, seq_len: int) -> int:
    """How many training windows the margin fit draws: ``FIT_TOKENS_PER_DIM`` x d tokens or more, at least
    one batch."""
    return max(cfg.batch_size, math.ceil(FIT_TOKENS_PER_DIM * hidden_size / seq_len))


def start_logit(cfg: DsmoeConfig) -> float:
    """The logit x Y at which the gates start: ``gate_margin`` where training fits them to it, else 0 (Y = 0
    as converted; a random start is centred on 0 too)."""
    return cfg.gate_margin if cfg.steps and cfg.gate_init == "margin" else 0.0


def gate_scale(cfg: DsmoeConfig) -> float:
    """The layers' gate scale: 1 for Eq. 7-8 exactly, 1 / g0 for gates that are neutral at their start
    value g0 = sigma(start logit) (1 / sigma(0) = 2 for Y = 0)."""
    weighting = cfg.gate_weighting
    if weighting == "auto":
        weighting = "paper" if cfg.gate_init == "random" else "neutral"
    return 1.0 if weighting == "paper" else 1.0 / sigmoid(start_logit(cfg))


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def logit(p: float) -> float:
    return math.log(p / (1.0 - p)) if 0.0 < p < 1.0 else math.copysign(math.inf, p - 0.5)
