"""Build inference modules (moeify.runtime) from plain MLP weights and a partition."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from moeify.arch.mlp import MlpWeights
from moeify.moe.experts.partition import ExpertPartition
from moeify.runtime.experts import ExpertMLP, HiddenNeurons, SharedNeuronExperts
from moeify.runtime.moe import MoeMLP

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _copy(linear: nn.Linear | None, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    if linear is None:
        return
    with torch.no_grad():
        linear.weight.copy_(weight)
        if linear.bias is not None:
            linear.bias.copy_(bias)


def load_neurons_(neurons: HiddenNeurons, mlp: MlpWeights) -> HiddenNeurons:
    """Copy the input half (up, gate and their biases) of ``mlp`` into ``neurons``."""
    _copy(neurons.up, mlp.up, mlp.up_bias)
    _copy(neurons.gate, mlp.gate, mlp.gate_bias)
    return neurons


def _uninitialised(build: Callable[[], ModuleT], like: torch.Tensor) -> ModuleT:
    """``build()`` on the device and in the dtype of ``like``, its parameters left uninitialised: the callers
    overwrite every one, so a random initialisation (on the host, then copied to the device) would be work
    thrown away, the slowest part of building a large layer."""
    with torch.device("meta"):
        module = build()
    return module.to_empty(device=like.device).to(like.dtype)


def expert_mlp(mlp: MlpWeights) -> ExpertMLP:
    """``mlp`` (usually a neuron subset of a dense MLP, without output bias) as an expert module, on the
    device and in the dtype of ``mlp``."""
    expert = _uninitialised(lambda: ExpertMLP(mlp.hidden_size, mlp.intermediate_size, mlp.act, mlp.gated,
                                              mlp.up_bias is not None), mlp.up)
    load_neurons_(expert.neurons, mlp)
    with torch.no_grad():
        expert.down.weight.copy_(mlp.down)
    return expert


def shared_neuron_experts(mlp: MlpWeights, sets: list[torch.Tensor]) -> SharedNeuronExperts:
    """Experts that are overlapping neuron subsets of ``mlp`` (equal sizes, each ascending), stored once:
    the union of ``sets`` and each set's positions in it."""
    union = torch.cat(sets).unique()  # sorted
    experts = _uninitialised(lambda: SharedNeuronExperts(mlp.hidden_size, len(union), len(sets), len(sets[0]),
                                                         mlp.act, mlp.gated, mlp.up_bias is not None), mlp.up)
    part = mlp.select(union)
    load_neurons_(experts.neurons, part)
    with torch.no_grad():
        experts.down.weight.copy_(part.down)
        experts.index.copy_(torch.stack([torch.searchsorted(union, s) for s in sets]))
        experts.neuron_ids.copy_(union)
    return experts


def common_neurons_shared(mlp: MlpWeights, sets: list[torch.Tensor]) -> tuple[ExpertMLP | None, SharedNeuronExperts]:
    """Overlapping experts (neuron subsets of ``mlp``, equal sizes, each ascending) routed top-1 with weight
    1, as an always-on shared part (the neurons every expert has: whichever expert a token gets, it runs
    them) and experts of the rest, stored once. The same function; the common neurons then run as one
    dense product instead of inside each routed expert. At least one neuron stays routed (experts that
    are all alike keep their last common neuron), so the layer keeps routed experts."""
    common = sets[0][torch.stack([torch.isin(sets[0], s) for s in sets]).all(dim=0)]
    if len(common) == len(sets[0]):
        common = common[:-1]
    rest = [s[~torch.isin(s, common)] for s in sets]
    shared = expert_mlp(mlp.select(common)) if common.numel() else None
    return shared, shared_neuron_experts(mlp, rest)


def moe_from_partition(mlp: MlpWeights, partition: ExpertPartition, router: nn.Module) -> MoeMLP:
    """The MoE layer whose shared part and experts are the partition's neuron subsets of ``mlp``;
    with every expert on it computes exactly ``mlp`` (CMoE Eq. 19)."""
    experts = [expert_mlp(mlp.select(part)) for part in partition.experts]
    shared = expert_mlp(mlp.select(partition.shared)) if partition.shared.numel() else None
    down_bias = None if mlp.down_bias is None else mlp.down_bias.detach().clone()
    layer = MoeMLP(experts, router, shared, down_bias)
    return layer.to(mlp.up.dtype)


def static_layer(mlp: MlpWeights, keep: torch.Tensor) -> MoeMLP:
    """The MLP narrowed, statically, to the ``keep`` neurons (a pruning baseline: nothing is routed)."""
    down_bias = None if mlp.down_bias is None else mlp.down_bias.detach().clone()
    layer = MoeMLP([], None, expert_mlp(mlp.select(keep.sort().values)), down_bias,
                   dense_width=mlp.intermediate_size)
    return layer.to(mlp.up.dtype)
