"""ToMoE: Converting Dense Large Language Models to Mixture-of-Experts through Dynamic Structural Pruning
(Gao et al., TMLR 2025).

1. Learning (§3.1-3.5, ``tomoe_modules``, ``tomoe_train``): the model's weights frozen, a hypernetwork
   generates expert embeddings (Eq. 1), each MLP token is routed top-1 by Straight-Through Gumbel-Softmax
   to an expert whose neurons are a Straight-Through Gumbel-Sigmoid mask (Eq. 2-3), attention heads lose
   dimensions statically on Q/K (s_0, RoPE pairs) and per token on V/O (s_t, Eq. 4-5); objective Eq. 10
   (in-place KL distillation + alpha R_P + beta R_U + gamma R_L) with the paper's defaults alpha = 16,
   beta = 2, gamma = 1, tau = 0.4, b = 3, AdamW lr 1e-3, weight decay 0.05, constant schedule.
2. Conversion (``tomoe_convert``): deterministic masks, experts widened to the layer maximum from the union,
   top-1 ``MoeMLP`` with unscaled outputs, Q/K narrower, V/O top-K as the dense products times each
   token's mask (measured faster on CPU than computing only the kept dimensions: ``runtime.attention``);
   the MoE layers as pseudo-MoE (Appendix B.3) through the runtime option ``pseudo_moe``
   (``moeify eval DIR --set pseudo_moe=true``).

Choices where the paper is open:
- Router = Linear(d, N) without a bias: argmax routing then maps exactly onto the standard MoE formats
  (Mixtral's gate has no bias).
- The Gumbel-Sigmoid noise is Eq. 15's single Gumbel(0, 1) sample: with b = 3 it drops essentially no
  neuron at the start (P(g < -3) ~ 2e-9), so training starts from the whole model as the paper says.
  Its median (0.37) makes training's masks slightly wider than the noise-free masks of the converted
  model; ``mask_noise=logistic`` (g1 - g2, median 0) removes that shift but drops 4.7 % of a logit-0 mask
  from the first step.
- The hypernetwork's Bi-GRU runs over the layers (batch: the N experts), z is (L, N, 32).
- T(d_MoE) of R_P counts V/O at the mean per-token width (K is its rounded mean after training) and MLPs at
  the widest expert (Eq. 8); T_total is the dense attention + MLP projections, so ``active_ratio`` is the
  record's activated-parameter ratio (``moe.accounting``).
- Training text is the calibration text; batches of ``batch_size`` windows of ``seq_len`` tokens. The
  paper trains 10,000 steps at batch 1 x 2048 tokens on 7B models; the default here is a budget for a
  2-core CPU at the paper's lr: 600 steps of 4 x 256 tokens (the training curves are in the record and its
  PNG).
- attention=on needs LLaMA-style attention (``moe.attention.head_dim``: LLaMA, Mistral, Qwen2); other families
  run with attention=off (MLP experts only, the paper's "w/o VO routing" ablation is the nearest). The
  default, auto, takes on where the model allows it and off elsewhere, and records which (and why).
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.tomoe.config import TomoeConfig, match_budget

TOMOE = Method(
    name="tomoe",
    paper="Gao et al., ToMoE: Converting Dense Large Language Models to Mixture-of-Experts through Dynamic "
          "Structural Pruning, TMLR 2025 (arXiv:2501.15316)",
    summary="hypernetwork-learned top-1 MLP experts and head-dim attention pruning, weights frozen (KD)",
    config_cls=TomoeConfig,
    convert=Deferred("moeify.methods.tomoe.convert", "convert"),
    match_budget=match_budget,
    runtime_options={"pseudo_moe": Deferred("moeify.methods.tomoe.pseudo_moe", "set_pseudo_moe")},
    memory=Deferred("moeify.methods.tomoe.memory", "memory"),
    keeps_attention=lambda config: config.attention == "off",
)

__all__ = ["TOMOE", "TomoeConfig"]
