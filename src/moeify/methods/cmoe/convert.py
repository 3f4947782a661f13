"""CMoE's conversion: profiling, shared experts, balanced k-means and the representative-neuron router,
one decoder layer at a time (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from moeify.arch.mlp import MlpWeights
from moeify.calibration.data import calibration_batches
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.stream import stream_layers
from moeify.methods.base import Conversion, ConversionContext
from moeify.methods.cmoe.analysis import routing_errors, routing_summary
from moeify.methods.cmoe.config import CarvingOptions
from moeify.moe.experts.build import load_neurons_, moe_from_partition
from moeify.moe.experts.partition import (
    ExpertPartition,
    balanced_kmeans,
    even_sizes,
    random_partition,
)
from moeify.moe.experts.refit import mean_refit, refit_down_
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import RepresentativeRouter


def atopk_markers(mlp: MlpWeights, x: Tensor, ka: int) -> Tensor:
    """Activation markers A (q, d_h) of Eq. 5-6: 1 where |h_i| is among the ka largest of its token."""
    normed = lambda w: None if w is None else torch.nn.functional.normalize(w.float(), dim=1)  # noqa: E731
    unit = replace(mlp, up=normed(mlp.up), gate=normed(mlp.gate), up_bias=None, gate_bias=None)
    h = unit.hidden(torch.nn.functional.normalize(x.float(), dim=-1))  # (q, d_h); Eq. 6
    markers = torch.zeros_like(h, dtype=torch.bool)
    markers.scatter_(1, h.abs().topk(ka, dim=1).indices, True)  # Eq. 5
    return markers


@dataclass(frozen=True)
class Carving:
    """One layer's result: the partition, each routed expert's representative neuron, k-means iterations."""

    partition: ExpertPartition
    representatives: Tensor
    iterations: int
    rates: Tensor


def carve(markers: Tensor, cfg: CarvingOptions, generator: torch.Generator) -> Carving:
    """Group neurons into shared and routed experts from their markers (q, d_h) (Eq. 7-14, 24).

    The rates, the k-means distances and centroids and the representatives are computed where ``markers``
    are (the work device); only the (d_h, k) distance matrix of each k-means iteration goes to the host, for
    the exact min-cost-flow assignment. The returned indices are on the host (they are small)."""
    device, d_h = markers.device, markers.shape[1]
    rates = markers.float().mean(dim=0)  # mu; Eq. 7
    sizes = even_sizes(d_h, cfg.num_experts)
    n_shared, capacities = sum(sizes[:cfg.num_shared]), sizes[cfg.num_shared:]
    if cfg.partition == "random":
        order = torch.randperm(d_h, generator=generator)
        shared = order[:n_shared]
        groups = random_partition(order[n_shared:], capacities, generator)
        routed = torch.cat(groups).to(device)
    else:
        shared = rates.topk(n_shared).indices  # S_Ns; Eq. 8
        keep = torch.ones(d_h, dtype=torch.bool, device=device)
        keep[shared] = False
        routed = keep.nonzero().squeeze(1)
    feats = markers[:, routed].T.float().contiguous()  # c_i, one row per routed neuron: (n_r, q)
    if cfg.partition == "random":
        labels = torch.cat([torch.full((g.numel(),), p, device=device) for p, g in enumerate(groups)])
        centroids = torch.stack([feats[labels == p].mean(dim=0) for p in range(len(capacities))])
        iterations = 0
    else:
        seeds = rates[routed].topk(len(capacities)).indices  # the highest-rate non-shared neurons
        labels, centroids, iterations = balanced_kmeans(feats, feats[seeds], capacities, max_iter=cfg.max_iter)
    experts, reps = [], []
    for p in range(len(capacities)):
        members = (labels == p).nonzero().squeeze(1)
        closest = (feats[members] - centroids[p]).norm(dim=1).argmin()  # R_p; Eq. 24
        experts.append(routed[members].sort().values.cpu())
        reps.append(routed[members[closest]])
    partition = ExpertPartition(shared=shared.sort().values.cpu(), experts=tuple(experts))
    return Carving(partition, torch.stack(reps).cpu(), iterations, rates.cpu())


def build_layer(mlp: MlpWeights, carving: Carving, cfg: CarvingOptions) -> MoeMLP:
    """The MoE layer of Eq. 17 with the router of Eq. 25 (and the scores/bias of Eq. 28-33)."""
    router = RepresentativeRouter(mlp.hidden_size, cfg.num_routed, cfg.top_k, mlp.act, mlp.gated,
                                  mlp.up_bias is not None, bias_speed=cfg.bias_speed, score=cfg.router_score)
    load_neurons_(router.neurons, mlp.select(carving.representatives))
    return moe_from_partition(mlp, carving.partition, router)


def convert(ctx: ConversionContext, cfg: CarvingOptions) -> Conversion:
    adapter, model_config = ctx.adapter, ctx.model.config
    seq_len = cfg.effective_seq_len(model_config)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    generator = torch.Generator().manual_seed(ctx.seed)
    layers: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    refits: list[dict[str, float]] = []
    from tqdm.auto import tqdm

    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device)
    for step in tqdm(steps, total=adapter.num_layers, desc="cmoe: carving layers", disable=not ctx.progress):
        inputs: list[Tensor] = []
        with capture_inputs(adapter.mlp_module(step.index), inputs.append):
            step.run()
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs])  # X: (q, d)
        mlp = adapter.mlp(step.index)
        carving = carve(atopk_markers(mlp, x, cfg.ka), cfg, generator)
        layer = build_layer(mlp, carving, cfg).to(x.device)
        if cfg.refit_down:
            refits.append(refit_down_(layer, mlp, x))
        adapter.replace_mlp_(step.index, layer)
        if cfg.analysis:
            errors.append(routing_errors(mlp, carving.partition, carving.representatives, cfg.top_k,
                                         cfg.router_score, x))
        layers.append({"layer": step.index, "kmeans_iterations": carving.iterations,
                       "expert_sizes": [e.numel() for e in carving.partition.experts],
                       "shared_size": carving.partition.shared.numel(),
                       "shared_mean_rate": float(carving.rates[carving.partition.shared].mean())
                       if carving.partition.shared.numel() else 0.0})
    details: dict[str, Any] = {"calibration": {"samples": cfg.calib_samples, "seq_len": seq_len,
                                               "tokens": int(batches.numel())}, "layers": layers}
    if errors:
        details["analysis"] = routing_summary(errors)
    if refits:
        details["refit_down"] = mean_refit(refits)
    model = ctx.model
    if cfg.finetunes:
        from moeify.methods.cmoe.finetune import finetune

        model, details["finetune"] = finetune(ctx, cfg, seq_len)
    return Conversion(model, details)
