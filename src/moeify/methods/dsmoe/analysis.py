"""DSMoE's analyses of a converted model on held-out text, written into the record (``details.analysis``).

- Appendix A, Table 4: perplexity and activated ratio for tau in 0.2, 0.3, ..., 0.8 (and the model's own
  tau) on each evaluation file. Table 4 counts the whole model (embeddings, norms and LM head always
  active: ``model_ratio``, ``moe.accounting.paper_ratio``); the rows also carry MoRE's APR and the MLP
  ratio, which every method's record has. Raising tau can only switch gates off (the active set at
  tau' > tau is a subset), so no ratio grows with tau.
- §6.3, Fig. 3: the mean number of activated experts per token in each layer on each evaluation file
  at the model's tau, as a heatmap PNG (files x layers) beside the model.

The activated ratios are the measured ones (MoeMLP stats): a threshold router has no nominal count.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moeify.calibration.data import TextSource
from moeify.evaluation.perplexity import perplexity
from moeify.methods.base import Analysis, ConversionContext
from moeify.methods.dsmoe.budget import set_tau_
from moeify.methods.dsmoe.config import DsmoeConfig
from moeify.moe.accounting import activated_parameters, moe_layers, paper_ratio, tracking_routing

TAUS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # Appendix A, Table 4
HEATMAP = "dsmoe_activated_experts.png"


def measure(model: nn.Module, tokenizer: Any, source: TextSource, seq_len: int) -> dict[str, Any]:
    """Perplexity, the measured activated ratios (Table 4's whole-model one, APR, MLP) and the mean activated
    experts per token in each layer."""
    with tracking_routing(model) as layers:
        ppl = perplexity(model, tokenizer, source, seq_len)
    active = activated_parameters(model, measured=True)
    per_layer = [float(layer.stats_expert_tokens.sum()) / layer.stats_tokens for layer in layers]
    return {"ppl": ppl.ppl, "model_ratio": paper_ratio(model, active, "model")["value"], "apr": active.apr,
            "mlp_ratio": active.mlp_ratio, "experts_per_layer": per_layer}


def tau_sweep(model: nn.Module, tokenizer: Any, sources: list[TextSource], seq_len: int,
              taus: tuple[float, ...] = TAUS) -> list[dict[str, Any]]:
    """One row per (tau, file); the routers' tau is restored afterwards."""
    original = [layer.router.tau for layer in moe_layers(model)]
    rows = []
    try:
        for tau in taus:
            set_tau_(model, tau)
            rows += [{"tau": tau, "data": s.name, **measure(model, tokenizer, s, seq_len)} for s in sources]
    finally:
        for layer, tau in zip(moe_layers(model), original):
            layer.router.set_option("tau", tau)
    return rows


def activation_heatmap(per_file: dict[str, list[float]], num_experts: int, tau: float) -> bytes:
    """Fig. 3: activated experts per token, files (rows) x layers (columns), as PNG bytes."""
    from moeify.plots import heatmap

    return heatmap(list(per_file.values()), row_labels=list(per_file), vmax=num_experts, xlabel="layer",
                   title=f"DSMoE: mean activated experts per token (of {num_experts}), tau = {tau:g}")


def analyze(ctx: ConversionContext, cfg: DsmoeConfig, sources: list[TextSource], seq_len: int) -> Analysis:
    tau = moe_layers(ctx.model)[0].router.tau  # the model's own: cfg.tau, or the one active_ratio matched
    sweep = tau_sweep(ctx.model, ctx.tokenizer, sources, seq_len, tuple(sorted({*TAUS, tau})))
    per_file = {row["data"]: row["experts_per_layer"] for row in sweep if row["tau"] == tau}
    out: dict[str, Any] = {"tau_sweep": sweep,
                           "activated_experts": {"tau": tau, "num_experts": cfg.num_experts, "per_file": per_file}}
    try:
        artifacts = {HEATMAP: activation_heatmap(per_file, cfg.num_experts, tau)}
        out["heatmap"] = HEATMAP
    except ImportError:
        artifacts = {}
        out["heatmap"] = None
        out["heatmap_skipped"] = "matplotlib is not installed (pip install 'moeify[plots]')"
    return Analysis(out, artifacts)
