"""The LLaMA-MoE random expert split (Zhu et al., 2024) as a training-free baseline: shared and routed
neurons drawn at random with CMoE's expert sizes, routed by CMoE's representative-neuron router (so it
runs without training). Every option is CMoE's; only the partition is fixed."""

from __future__ import annotations

from typing import Literal

from moeify.methods.base import Deferred, Method
from moeify.methods.cmoe.config import CarvingOptions, match_budget
from moeify.options import method_config, option


@method_config
class RandomSplitConfig(CarvingOptions):
    partition: Literal["random"] = option("random", "fixed: shared and routed neurons drawn at random")


RANDOM_SPLIT = Method(
    name="random_split",
    paper="baseline: LLaMA-MoE random expert split (Zhu et al., 2024), training-free, with CMoE's "
          "representative-neuron router so that it can run without training",
    summary="baseline: random neuron split into shared/routed experts, options as cmoe",
    config_cls=RandomSplitConfig,
    convert=Deferred("moeify.methods.cmoe.convert", "convert"),
    match_budget=match_budget,
    memory=Deferred("moeify.methods.cmoe.memory", "memory"),  # CMoE's conversion, its partition drawn
    paper_ratio="ffn",
    partitions_mlp=True,
    layer_by_layer=True,
)

__all__ = ["RANDOM_SPLIT", "RandomSplitConfig"]
