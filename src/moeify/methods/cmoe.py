"""CMoE: Fast Carving of Mixture-of-Experts for Efficient LLM Inference (Pei et al., 2025).

Per decoder layer, on calibration activations streamed one layer at a time:

1. Profiling (§IV-A, Eq. 5-7): H = Swish(X W_gate) * (X W_up) with X normalised per token and the
   weight vectors of W_gate and W_up normalised per neuron (the paper normalises "X, W_gate and W_up"
   without saying along which axis; per-token / per-neuron L2 is our choice: it removes the
   magnitudes the paper wants removed and keeps the per-neuron geometry). For two-layer MLPs H is
   act(X W_up) with the same normalisation and no bias. ATopK marks the ``ka`` neurons of largest |h_i|
   per token; the activation rate mu_i is the mean of neuron i's markers.
2. Shared experts (Eq. 8-9): the neurons with the highest mu.
3. Routed experts (Eq. 10-14): balanced k-means over the marker vectors c_i of the other neurons,
   centroids initialised at the highest-mu non-shared neurons, each assignment solved exactly.
4. Router (Eq. 24-26): each routed expert's representative neuron (closest to its centroid) computes
   the expert's score; top-``top_k`` experts run with unit weight (Eq. 17), generalised to
   g = 1 + softmax(s)_i u_i with u = 0 and the load-balancing bias b (Eq. 28-33).
5. Optional light fine-tuning (§V): LoRA (rank 8, alpha 32) plus u at its own learning rate, b moved by
   gamma after every step.

When d_h is not a multiple of the expert count, expert sizes differ by at most one (larger ones first,
the shared part takes the first ``num_shared`` sizes), so no neuron is dropped. The ``random``
partition is the LLaMA-MoE baseline: shared and routed neurons drawn at random with the same sizes,
the router still built from each group's representative neuron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import PreTrainedConfig

from moeify.arch.mlp import MlpWeights
from moeify.calibration.data import calibration_batches
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.stream import stream_layers
from moeify.methods.base import ConversionContext, Method
from moeify.methods.options import OptionError, option, require_at_most
from moeify.moe.build import load_neurons_, moe_from_partition
from moeify.moe.partition import ExpertPartition, balanced_kmeans, even_sizes, random_partition
from moeify.runtime.moe import MoeMLP, RepresentativeRouter

_SPEC = re.compile(r"^S(\d+)A(\d+)E(\d+)$")


@dataclass(frozen=True)
class CmoeConfig:
    num_experts: int = option(8, "E: total experts per layer, shared included", low=2)
    num_shared: int = option(1, "S: shared (always-on) experts", low=0)
    top_k: int = option(1, "A: routed experts activated per token", low=1)
    spec: str | None = option(None, "shorthand for S/A/E, e.g. S1A1E8 (= 25% of the MLP active)")
    ka: int = option(10, "K_a of ATopK (Eq. 5): neurons marked active per token", low=1)
    calib_samples: int = option(8, "calibration sequences", low=1)
    seq_len: int | None = option(None, "calibration sequence length (default: min(2048, model context))", low=2)
    max_iter: int = option(100, "balanced k-means iterations at most", low=1)
    partition: Literal["balanced_kmeans", "random"] = option("balanced_kmeans", "expert grouping; random = LLaMA-MoE split")
    bias_speed: float = option(0.001, "gamma: load-balancing bias update speed (Eq. 33)", low=0.0)
    finetune_steps: int = option(0, "light fine-tuning steps (0 = training-free)", low=0)
    finetune_batch_size: int = option(4, "fine-tuning sequences per step", low=1)
    lr: float = option(5.95e-5, "fine-tuning learning rate of the LoRA weights", low=0.0, low_open=True)
    u_lr: float = option(1e-3, "learning rate of the score scale u", low=0.0, low_open=True)
    lora_rank: int = option(8, "LoRA rank", low=1)
    lora_alpha: float = option(32.0, "LoRA alpha", low=0.0, low_open=True)

    def __post_init__(self) -> None:
        if self.spec is not None:
            match = _SPEC.match(self.spec)
            if not match:
                raise OptionError(f"spec={self.spec!r} must look like S1A1E8 (shared, activated, total experts)")
            shared, active, total = map(int, match.groups())
            object.__setattr__(self, "num_shared", shared)
            object.__setattr__(self, "top_k", active)
            object.__setattr__(self, "num_experts", total)
            object.__setattr__(self, "spec", None)
        if self.num_shared >= self.num_experts:
            raise OptionError(f"num_shared={self.num_shared} must be < num_experts={self.num_experts} "
                              "(at least one routed expert)")
        if self.top_k > self.num_routed:
            raise OptionError(f"top_k={self.top_k} must be <= the routed experts "
                              f"num_experts - num_shared = {self.num_routed}")

    @property
    def num_routed(self) -> int:
        return self.num_experts - self.num_shared

    def check(self, model_config: PreTrainedConfig) -> None:
        d_h = model_config.intermediate_size
        require_at_most("num_experts", self.num_experts, d_h, "the MLP width d_h")
        require_at_most("ka", self.ka, d_h, "the MLP width d_h")
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def effective_seq_len(self, model_config: PreTrainedConfig) -> int:
        return self.seq_len or min(2048, model_config.max_position_embeddings)


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


def carve(markers: Tensor, cfg: CmoeConfig, generator: torch.Generator) -> Carving:
    """Group neurons into shared and routed experts from their markers (q, d_h) (Eq. 7-14, 24)."""
    d_h = markers.shape[1]
    rates = markers.float().mean(dim=0)  # mu; Eq. 7
    sizes = even_sizes(d_h, cfg.num_experts)
    n_shared, capacities = sum(sizes[:cfg.num_shared]), sizes[cfg.num_shared:]
    if cfg.partition == "random":
        order = torch.randperm(d_h, generator=generator)
        shared = order[:n_shared]
        groups = random_partition(order[n_shared:], capacities, generator)
        routed = torch.cat(groups)
    else:
        shared = rates.topk(n_shared).indices  # S_Ns; Eq. 8
        keep = torch.ones(d_h, dtype=torch.bool)
        keep[shared] = False
        routed = keep.nonzero().squeeze(1)
    feats = markers[:, routed].T.float().contiguous()  # c_i, one row per routed neuron: (n_r, q)
    if cfg.partition == "random":
        labels = torch.cat([torch.full((g.numel(),), p) for p, g in enumerate(groups)])
        centroids = torch.stack([feats[labels == p].mean(dim=0) for p in range(len(capacities))])
        iterations = 0
    else:
        seeds = rates[routed].topk(len(capacities)).indices  # the highest-rate non-shared neurons
        labels, centroids, iterations = balanced_kmeans(feats, feats[seeds], capacities, max_iter=cfg.max_iter)
    experts, reps = [], []
    for p in range(len(capacities)):
        members = (labels == p).nonzero().squeeze(1)
        closest = (feats[members] - centroids[p]).norm(dim=1).argmin()  # R_p; Eq. 24
        experts.append(routed[members].sort().values)
        reps.append(routed[members[closest]])
    partition = ExpertPartition(shared=shared.sort().values, experts=tuple(experts))
    return Carving(partition, torch.stack(reps), iterations, rates)


def build_layer(mlp: MlpWeights, carving: Carving, cfg: CmoeConfig) -> MoeMLP:
    """The MoE layer of Eq. 17 with the router of Eq. 25 (and the scores/bias of Eq. 28-33)."""
    router = RepresentativeRouter(mlp.hidden_size, cfg.num_routed, cfg.top_k, mlp.act, mlp.gated,
                                  mlp.up_bias is not None, bias_speed=cfg.bias_speed)
    load_neurons_(router.neurons, mlp.select(carving.representatives))
    return moe_from_partition(mlp, carving.partition, router)


def convert(ctx: ConversionContext, cfg: CmoeConfig) -> dict[str, Any]:
    adapter, model_config = ctx.adapter, ctx.model.config
    seq_len = cfg.effective_seq_len(model_config)
    batches = calibration_batches(ctx.calib, ctx.tokenizer, cfg.calib_samples, seq_len, ctx.seed)
    generator = torch.Generator().manual_seed(ctx.seed)
    layers: list[dict[str, Any]] = []
    from tqdm.auto import tqdm

    steps = stream_layers(ctx.model, adapter, batches, device=ctx.device)
    for step in tqdm(steps, total=adapter.num_layers, desc="cmoe: carving layers", disable=not ctx.progress):
        inputs: list[Tensor] = []
        with capture_inputs(adapter.mlp_module(step.index), inputs.append):
            step.run()
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs])  # X: (q, d)
        mlp = adapter.mlp(step.index)
        carving = carve(atopk_markers(mlp, x, cfg.ka).cpu(), cfg, generator)  # profiling on device, grouping on CPU
        adapter.replace_mlp_(step.index, build_layer(mlp, carving, cfg).to(x.device))
        layers.append({"layer": step.index, "kmeans_iterations": carving.iterations,
                       "expert_sizes": [e.numel() for e in carving.partition.experts],
                       "shared_size": carving.partition.shared.numel(),
                       "shared_mean_rate": float(carving.rates[carving.partition.shared].mean())
                       if carving.partition.shared.numel() else 0.0})
    details: dict[str, Any] = {"calibration": {"samples": cfg.calib_samples, "seq_len": seq_len,
                                               "tokens": int(batches.numel())}, "layers": layers}
    if cfg.finetune_steps:
        from moeify.methods.cmoe_finetune import finetune

        details["finetune"] = finetune(ctx, cfg, seq_len)
    return details


CMOE = Method(
    name="cmoe",
    paper="Pei et al., CMoE: Fast Carving of Mixture-of-Experts for Efficient LLM Inference, 2025 (arXiv:2502.04416)",
    summary="training-free carving: activation profiling, shared experts, balanced k-means, analytic router",
    config_cls=CmoeConfig,
    convert=convert,
)


@dataclass(frozen=True)
class RandomSplitConfig(CmoeConfig):
    partition: Literal["random"] = option("random", "fixed: shared and routed neurons drawn at random")


RANDOM_SPLIT = Method(
    name="random_split",
    paper="baseline: LLaMA-MoE random expert split (Zhu et al., 2024), training-free, with CMoE's "
          "representative-neuron router so that it can run without training",
    summary="baseline: random neuron split into shared/routed experts, options as cmoe",
    config_cls=RandomSplitConfig,
    convert=convert,
)
