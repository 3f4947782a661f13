"""MoRE's conversion, one decoder layer at a time: backbone, spectral petals, cosine prototypes (see the
package docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from moeify.arch.mlp import MlpWeights
from moeify.calibration.data import calibration_batches
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.observers import CoActivation
from moeify.calibration.stream import stream_layers
from moeify.methods.base import Conversion, ConversionContext
from moeify.methods.more.config import MoreConfig
from moeify.methods.more.layer_budget import (
    Budget,
    LayerShape,
    candidate_layers,
    solve_budget,
    solve_naive_budget,
)
from moeify.moe.experts.build import moe_from_partition, static_layer
from moeify.moe.experts.importance import channel_importance
from moeify.moe.experts.partition import ExpertPartition, random_partition
from moeify.moe.experts.spectral import bound_cluster_sizes, spectral_clusters
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import PrototypeRouter, RandomRouter


def petals(affinity: np.ndarray, channels: Tensor, r: int, cfg: MoreConfig, seed: int) -> list[Tensor]:
    """Spectral clusters of the co-activation graph ``affinity`` over ``channels`` (C restricted to them,
    diagonal zeroed: ``CoActivation.coactivation_among``), sizes bounded."""
    mean = len(channels) / r
    low = max(1, int(np.floor(cfg.min_size_ratio * mean)))
    high = max(int(np.ceil(cfg.max_size_ratio * mean)), int(np.ceil(mean)))
    labels = bound_cluster_sizes(spectral_clusters(affinity, r, seed=seed), affinity, r, low, high)
    return [channels[torch.from_numpy(np.flatnonzero(labels == i))] for i in range(r)]


class _PrototypeAccumulator:
    """Eq. 9-11: assign tokens to the expert of largest activation energy, sum their inputs."""

    def __init__(self, mlp: MlpWeights, experts: list[Tensor], alpha: float) -> None:
        self.mlp, self.alpha = mlp, alpha
        self.members = [e.to(mlp.up.device) for e in experts]
        self.sums = torch.zeros(len(experts), mlp.hidden_size, dtype=torch.float64)
        self.counts = torch.zeros(len(experts), dtype=torch.float64)

    def update(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        h = self.mlp.hidden(x)
        energy = torch.stack([h[:, e].norm(dim=1) / e.numel() ** self.alpha for e in self.members], dim=1)
        onehot = torch.nn.functional.one_hot(energy.argmax(dim=1), len(self.members)).double()
        self.sums += (onehot.T @ x.double()).cpu()  # summed on the device: (experts, d) crosses, not the tokens
        self.counts += onehot.sum(0).cpu()

    def prototypes(self) -> Tensor:
        return self.sums / self.counts.clamp_min(1)[:, None]  # mu_i; Eq. 11 (zero if no token chose i)


def _routed_layer(mlp: MlpWeights, shared: Tensor, experts: list[Tensor], prototypes: Tensor,
                  random_routing: torch.Generator | None = None) -> MoeMLP:
    """The MoRE layer with its prototype router, or (MoRE-Random) a router that assigns tokens at random."""
    if random_routing is None:
        router = PrototypeRouter(mlp.hidden_size, len(experts), top_k=1)
        router.prototypes.copy_(prototypes.float())
    else:
        router = RandomRouter(mlp.hidden_size, len(experts), top_k=1)
        router.directions.copy_(torch.randn(router.directions.shape, generator=random_routing))
    return moe_from_partition(mlp, ExpertPartition(shared, tuple(e.sort().values for e in experts)), router)


def _coactivation(step_run, capture, mlp: MlpWeights, cfg: MoreConfig) -> CoActivation:
    """The layer's activation statistics over the calibration batches (MoRE §2.2)."""
    m = mlp.intermediate_size
    stats = CoActivation(mlp.hidden_size, m, max(1, int(cfg.act_ratio * m)))  # k_act; Eq. 4
    with capture(lambda x: stats.update(x, mlp.hidden(x))):
        step_run()
    return stats


def convert_layer(step_run, capture, mlp: MlpWeights, k_share: int, cfg: MoreConfig, seed: int) -> tuple[MoeMLP, dict]:
    """Build one MoRE layer; ``step_run`` replays the layer over the calibration batches while
    ``capture(observe)`` feeds the MLP inputs to ``observe``. For ``naive``, ``k_share`` is the number
    of disjoint clusters."""
    m, r = mlp.intermediate_size, cfg.num_experts
    stats = _coactivation(step_run, capture, mlp, cfg)
    score = channel_importance(mlp, stats.squares)
    order = score.argsort(descending=True)
    generator = torch.Generator().manual_seed(seed)
    info: dict[str, Any] = {"k_act": stats.k_act, "never_activated": stats.never_activated}  # Table 4
    if cfg.variant == "backbone":
        keep = order[:k_share + round((m - k_share) / r)]  # the same budget, static
        return static_layer(mlp, keep), {**info, "backbone": keep.numel()}
    if cfg.variant == "naive":
        shared, routed, r = order[:0], torch.arange(m), k_share
    else:
        shared, routed = order[:k_share].sort().values, order[k_share:].sort().values
    affinity = stats.coactivation_among(routed)  # C_R with zeroed diagonal
    del stats  # the m x m counts: clustering needs only C_R
    groups = petals(affinity, routed, r, cfg, seed)
    if cfg.variant == "random_petals":
        groups = list(random_partition(routed, [g.numel() for g in groups], generator))
    accumulator = _PrototypeAccumulator(mlp, [torch.cat([shared, g]) for g in groups], cfg.alpha)  # E_i
    with capture(accumulator.update):
        step_run()
    layer = _routed_layer(mlp, shared, groups, accumulator.prototypes(),
                          generator if cfg.variant == "random" else None)
    info.update({"backbone": shared.numel(), "petal_sizes": [g.numel() for g in groups],
                 "calib_tokens_per_expert": accumulator.counts.long().tolist()})
    return layer, info


def convert(ctx: ConversionContext, cfg: MoreConfig) -> Conversion:
    adapter, config = ctx.adapter, ctx.model.config
    shapes = {i: LayerShape(adapter.mlp(i).intermediate_size, adapter.mlp(i).params_per_neuron())
              for i in range(adapter.num_layers)}
    total = sum(adapter.attention_params(i) + adapter.dense_mlp_params(i) for i in range(adapter.num_layers))
    candidates = candidate_layers(cfg.layers, config.num_hidden_layers)
    budget: Budget = solve_budget(candidates, shapes, cfg.num_experts, total, cfg.target_pr, cfg.share_ratio)
    if cfg.variant == "naive":  # k_share carries the cluster count of each naive layer
        layers_, clusters, pr = solve_naive_budget(candidates, shapes, cfg.num_experts, total, budget.pruning_rate)
        budget = Budget(layers_, {i: clusters for i in layers_}, pr)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, cfg.seq_len, ctx.seed)
    layers = []
    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device, batch_size=8)
    for step in tqdm(steps, total=adapter.num_layers, desc="more: recognising experts", disable=not ctx.progress):
        if step.index not in budget.layers:
            continue
        mlp = adapter.mlp(step.index)
        capture = lambda observe: capture_inputs(adapter.mlp_module(step.index), observe)  # noqa: E731
        layer, info = convert_layer(step.run, capture, mlp, budget.backbone[step.index], cfg, ctx.seed + step.index)
        adapter.replace_mlp_(step.index, layer.to(mlp.up.device))
        layers.append({"layer": step.index, **info})
    return Conversion(ctx.model, {
        "layers": layers, "converted_layers": budget.layers, "pruning_rate_uniform": budget.pruning_rate,
        "calibration": {"samples": cfg.calib_samples, "seq_len": cfg.seq_len, "tokens": int(batches.numel())}})
