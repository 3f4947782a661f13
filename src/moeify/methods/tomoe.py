"""ToMoE: Converting Dense Large Language Models to Mixture-of-Experts through Dynamic Structural Pruning
(Gao et al., TMLR 2025).

1. Learning (§3.1-3.5, ``tomoe_modules``, ``tomoe_train``): the model's weights frozen, a hypernetwork
   generates expert embeddings (Eq. 1), each MLP token is routed top-1 by Straight-Through Gumbel-Softmax
   to an expert whose neurons are a Straight-Through Gumbel-Sigmoid mask (Eq. 2-3), attention heads lose
   dimensions statically on Q/K (s_0, RoPE pairs) and per token on V/O (s_t, Eq. 4-5); objective Eq. 10
   (in-place KL distillation + alpha R_P + beta R_U + gamma R_L) with the paper's defaults alpha = 16,
   beta = 2, gamma = 1, tau = 0.4, b = 3, AdamW lr 1e-3, weight decay 0.05, constant schedule.
2. Conversion (``tomoe_convert``): deterministic masks, experts widened to the layer maximum from the union,
   top-1 ``MoeMLP`` with unscaled outputs, Q/K narrower, V/O top-K computed by gathering; pseudo-MoE
   (Appendix B.3) as the runtime option ``pseudo_moe`` (``moeify eval DIR --set pseudo_moe=true``).

Choices where the paper is open:
- Router = Linear(d, N) without a bias: argmax routing then maps exactly onto the standard MoE formats
  (Mixtral's gate has no bias).
- The Gumbel-Sigmoid noise is logistic (g1 - g2 of two Gumbel samples, the two-class Gumbel-softmax);
  Eq. 15 writes one Gumbel sample, whose median (0.37) would make training's masks systematically wider
  than the noise-free masks of the converted model.
- The hypernetwork's Bi-GRU runs over the layers (batch: the N experts), z is (L, N, 32).
- T(d_MoE) of R_P counts V/O at the mean per-token width (K is its rounded mean after training) and MLPs at
  the widest expert (Eq. 8); T_total is the dense attention + MLP projections, so ``active_ratio`` is the
  record's activated-parameter ratio (``moe.accounting``).
- Training text is the calibration text; batches of ``batch_size`` windows of ``seq_len`` tokens. The
  paper trains 10,000 steps at batch 1 x 2048 tokens on 7B models; the default here is a budget for a
  2-core CPU at the paper's lr: 600 steps of 4 x 256 tokens (about a minute for stories260K). There the
  training masks reach p = 0.5 after about 200 steps and the KD loss levels off by the end (curves in the
  record and the PNG); held-out perplexity at p = 0.5: 50.8 (lr 5e-3 for 150 steps: 46.4).
- attention=on needs LLaMA-style attention (``moe.head_dim``: LLaMA, Mistral, Qwen2); other families
  run with attention=off (MLP experts only, the paper's "w/o VO routing" ablation is the nearest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedConfig

from moeify.evaluation.plots import training_curves
from moeify.methods.base import ConversionContext, Method
from moeify.methods.options import OptionError, option, require_at_most, require_work_dir_for_resume

CURVES_PNG = "tomoe_training.png"


@dataclass(frozen=True)
class TomoeConfig:
    num_experts: int = option(8, "N: experts per MLP (top-1 routed)", low=2)
    active_ratio: float = option(0.5, "p: activated share of the attention + MLP projections (Eq. 8)",
                                 low=0.0, high=1.0, low_open=True)
    attention: Literal["on", "off"] = option("on", "on: Q/K static + V/O top-K head-dim pruning; off: MLP experts only")
    steps: int = option(600, "optimizer steps of the router/mask learning (the paper: 10,000)", low=1)
    lr: float = option(1e-3, "AdamW learning rate (constant)", low=0.0, low_open=True)
    weight_decay: float = option(0.05, "AdamW weight decay", low=0.0)
    tau: float = option(0.4, "Gumbel temperature of Eq. 14-15", low=0.0, low_open=True)
    alpha: float = option(16.0, "weight of R_P, the parameter regulariser (Eq. 8)", low=0.0)
    beta: float = option(2.0, "weight of R_U, the union-of-experts regulariser (Eq. 7)", low=0.0)
    gamma: float = option(1.0, "weight of R_L, the load-balancing loss (Eq. 9)", low=0.0)
    batch_size: int = option(4, "sequences per optimizer step", low=1)
    seq_len: int | None = option(None, "training window (default: min(256, model context))", low=2)
    calib_samples: int = option(8, "calibration windows that fix K of the V/O top-K (§3.3)", low=1)
    checkpoint_every: int = option(100, "steps between checkpoints in the work folder (0: at the end only)", low=0)
    resume: bool = option(False, "continue from the latest checkpoint in the work folder and finish")

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("num_experts", self.num_experts, model_config.intermediate_size, "the MLP width d_mid")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(256, model_config.max_position_embeddings)


def convert(ctx: ConversionContext, cfg: TomoeConfig) -> dict[str, Any]:
    from moeify.methods.tomoe_convert import convert_
    from moeify.methods.tomoe_train import learn
    from moeify.moe.head_dim import head_dim_support

    require_work_dir_for_resume(cfg.resume, ctx.work_dir)
    if cfg.attention == "on" and (reason := head_dim_support(ctx.adapter.attention_module(0))):
        raise OptionError(f"attention=on is not possible for this model: {reason}; use attention=off")
    seq_len = cfg.effective_seq_len(ctx.model.config)
    theta, masked, log = learn(ctx, cfg, seq_len)
    structure = convert_(ctx, theta, masked, cfg, seq_len)
    curves = {name: log["curves"][key] for name, key in (("KD loss", "kd"), ("R_P", "r_p"), ("R_U", "r_u"),
                                                          ("R_L", "r_l"), ("T / T_total", "ratio"))}
    ctx.artifacts[CURVES_PNG] = training_curves(curves, title=f"ToMoE training (p = {cfg.active_ratio})")
    return {**structure, "train_seq_len": seq_len, "training": log, "curves_png": CURVES_PNG}


TOMOE = Method(
    name="tomoe",
    paper="Gao et al., ToMoE: Converting Dense Large Language Models to Mixture-of-Experts through Dynamic "
          "Structural Pruning, TMLR 2025 (arXiv:2501.15316)",
    summary="hypernetwork-learned top-1 MLP experts and head-dim attention pruning, weights frozen (KD)",
    config_cls=TomoeConfig,
    convert=convert,
)
