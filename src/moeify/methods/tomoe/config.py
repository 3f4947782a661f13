"""ToMoE's options: experts, the activated share p, attention pruning, the distillation's budget and
regulariser weights (the paper's defaults, Table 8 and §4)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from moeify.options import MethodOptions, Training, method_config, option, require_at_most, require_multiple

# Theta's sizes (Table 8), which the memory estimate reads too
EMBED_DIM = 128   # d_e
Z_DIM = 32        # the hypernetwork's input width
GRU_HIDDEN = 64   # per direction: 2 x 64 = d_e

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter


@method_config
class TomoeConfig(MethodOptions):
    num_experts: int = option(8, "N: experts per MLP (top-1 routed)", low=2)
    active_ratio: float = option(0.5, "p: activated share of the attention + MLP projections (Eq. 8)",
                                 low=0.0, high=1.0, low_open=True)
    attention: Literal["auto", "on", "off", "heads"] = option(
        "auto", "on: Q/K static + V/O top-K head-dim pruning; off: MLP experts only; auto: on where the model's "
                "attention allows it (not where q/k are normalised over the whole head, as Qwen3 and Gemma-3 do); "
                "heads: whole key/value heads with their query heads pruned by one static mask per layer, learned "
                "as s_0 (Table 13's 'Head Pruning', which the paper abandoned)")
    steps: int = option(600, "optimizer steps of the router/mask learning (the paper: 10,000)", low=1)
    lr: float = option(1e-3, "AdamW learning rate (constant)", low=0.0, low_open=True)
    weight_decay: float = option(0.05, "AdamW weight decay", low=0.0)
    tau: float = option(0.4, "Gumbel temperature of Eq. 14-15", low=0.0, low_open=True)
    mask_noise: Literal["gumbel", "logistic"] = option(
        "gumbel", "noise g of the neuron masks (Eq. 15): one Gumbel(0, 1) sample (the paper), or logistic "
                  "(median 0, but drops ~5 % of every mask from the first step)")
    objective: Literal["kd", "lm"] = option(
        "kd", "the loss's first term: kd, KL(dense || masked) by in-place distillation (the paper); lm, next-token "
              "cross-entropy on the training text (Fig. 6c's ablation)")
    vo_routing: bool = option(True, "V/O head dimensions chosen per token (Eq. 4-5); false: one static V/O mask per "
                                    "layer, learned as Q/K's (Table 13's 'w/o VO routing')")
    embeddings: Literal["global", "local"] = option(
        "global", "what the attention masks are made from: global, the hypernetwork's expert embeddings (Eq. 1, the "
                  "paper); local, a learned vector of each attention's own, the expert embeddings then serve the "
                  "MLPs only (Table 13's 'Local Emb')")
    alpha: float = option(16.0, "weight of R_P, the parameter regulariser (Eq. 8)", low=0.0)
    beta: float = option(2.0, "weight of R_U, the union-of-experts regulariser (Eq. 7)", low=0.0)
    gamma: float = option(1.0, "weight of R_L, the load-balancing loss (Eq. 9)", low=0.0)
    batch_size: int = option(4, "sequences per optimizer step", low=1)
    grad_accum: int = option(1, "micro-batches per step (batch_size must be a multiple): memory for time; the "
                                "token statistics of R_L and R_U are then per micro-batch", low=1)
    seq_len: int | None = option(None, "training window (default: min(256, model context))", low=2)
    calib_samples: int = option(8, "calibration windows that fix K of the V/O top-K (§3.3)", low=1)
    checkpoint_every: int = option(100, "steps between checkpoints in the work folder (0: at the end only)", low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")
    recompute: bool = option(True, "activation checkpointing while training: each decoder layer's activations are "
                                   "recomputed in the backward pass (far less memory, about 1/3 more compute)")
    frozen_weights: Literal["float32", "working"] = option(
        "float32", "how a bfloat16/float16 model's frozen weights compute while Theta trains: float32 (held in "
                   "float32 during training: a bfloat16 conversion learns what the float32 conversion of the same "
                   "weights learns; the weights take float32's memory), or working (kept in their dtype, the "
                   "passes under its autocast: half that memory, but the masks learned differ, and the "
                   "converted model's perplexity with them)")

    def validate(self) -> None:
        require_multiple("batch_size", self.batch_size, "grad_accum", self.grad_accum)

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("num_experts", self.num_experts, model_config.intermediate_size, "the MLP width d_mid")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(256, model_config.max_position_embeddings)

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        return self.calib_samples, self.effective_seq_len(model_config)

    def training(self, model_config: PreTrainedConfig) -> Training:
        """The router and mask learning: the masks' modules train, the model's weights stay frozen."""
        return Training(False, self.batch_size, self.grad_accum, self.effective_seq_len(model_config), self.recompute)


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """p is the activated-parameter ratio itself (R_P, Eq. 8): ``active_ratio = apr``."""
    return [{"active_ratio": apr}], f"active_ratio={apr}"
