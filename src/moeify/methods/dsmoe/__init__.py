"""DSMoE: Matrix-Partitioned Experts with Dynamic Routing for Computation-Efficient Dense LLMs
(Lv et al., 2025).

1. FFN partitioning (§4.1, Eq. 6): each MLP's hidden neurons are cut into ``num_experts`` contiguous
   blocks (sizes differing by at most one when d_h is not a multiple, larger first: 172 into 8 gives
   4 x 22 + 4 x 21); no shared part. The sum of every expert's output is the dense MLP exactly.
2. Gates (Eq. 7-8): g = sigma(x Y), Y in R^{d x n}; expert i contributes when its gate passes tau, with
   weight (n / |A|) * g_i * s, |A| the token's number of active experts, s the gate scale
   (``ThresholdRouter``). Three choices the paper leaves open, made so that the conversion is exact:
   - Y = 0 at conversion, so g = 1/2 for every token and expert.
   - The gate value enters relative to its start value g0 (s = 1 / g0, ``gate_weighting=neutral``):
     Eq. 7's "o_i * G(g_i)" alone would scale the MLP by g0 with every expert on. Untrained, g0 = 1/2
     and every weight is 2 * 1/2 = 1: the dense model (tested on every family at tau = 0).
   - A gate passes when g >= tau (the paper: g > tau). They differ only at g = tau exactly, i.e. for
     untrained gates at tau = 1/2, which therefore pass: the untrained model at the default tau is the
     dense model too.
   A token none of whose gates passes tau gets no expert: the layer's output for it is the MLP's output
   bias alone (zero in bias-free families, so its residual stream passes on unchanged), and it counts as
   zero activated experts. Eq. 8 would divide by zero; skipping the FFN is what "propagated only when
   the gate exceeds tau" says.
3. Continued training (§4.2-4.3, ``dsmoe_train``): straight-through estimator, LM + sparsity loss, and
   the ablations ``no_ste`` (§6.1) and ``no_gate`` (§6.2) as ``variant``. By default the gates start
   on, fitted so that x Y = 1 on at least 4 d tokens of the training text (g0 = sigma(1) = 0.73, each
   weighing 1: the dense model up to the fit's residual), not at the threshold (see ``train.py``).
4. Inference: ``MoeMLP`` runs only the experts whose gates pass tau, per token; ``tau`` is a runtime
   option (``moeify eval DIR --set tau=0.6``). ``active_ratio`` sets it after training for a given APR
   (``budget.py``): how ``moeify compare`` matches DSMoE to the methods that take a budget.
5. Analyses (``dsmoe_analysis``): perplexity and activated-parameter ratio for tau in 0.2..0.8
   (Appendix A, Table 4) and the activated experts per layer on each evaluation file (Fig. 3, PNG).

Defaults, for the scale of the embedded stories260K (5 layers, d = 64, d_h = 172) and its 28.8k-token
training text; the paper trains 1B-7B models on 10B tokens with AdamW, lr 2e-5, batch 32 x 1024 tokens.
Here: 200 steps of 8 x 256 tokens (410k tokens, about 14 passes over the text, minutes on a CPU), lr
2e-4 for the weights (10x the paper's: a run of 410k tokens needs larger steps than one of 10B),
1e-2 for the gates (the paper has one rate for every parameter; the gates start fitted on, above tau, and
must travel from there across tau within a run this short, far farther than the pre-trained weights
should move), sparsity weight 1 (Eq. 19). Every effective option is recorded with the run; the measured effect
is in ``benchmarks/bench_dsmoe.py`` and docs/results.md.
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.dsmoe.config import DsmoeConfig, match_budget

DSMOE = Method(
    name="dsmoe",
    paper="Lv et al., DSMoE: Matrix-Partitioned Experts with Dynamic Routing for Computation-Efficient "
          "Dense LLMs, EMNLP 2025 (arXiv:2502.12455)",
    summary="contiguous FFN blocks, sigmoid-threshold gates trained with STE + sparsity loss; tau at run time",
    config_cls=DsmoeConfig,
    convert=Deferred("moeify.methods.dsmoe.convert", "convert"),
    analyze=Deferred("moeify.methods.dsmoe.convert", "analyze"),
    refit=Deferred("moeify.methods.dsmoe.convert", "refit"),
    memory=Deferred("moeify.methods.dsmoe.memory", "memory"),
    match_budget=match_budget,
    paper_ratio="model",
    partitions_mlp=True,
)

__all__ = ["DSMOE", "DsmoeConfig"]
