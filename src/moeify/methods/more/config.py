"""MoRE's options: petals, activation sets, backbone budget, layers, calibration, ablation variants."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from moeify.methods.more.layer_budget import (
    candidate_layers,
)
from moeify.options import MethodOptions, OptionError, method_config, option, require_at_most

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter


@method_config
class MoreConfig(MethodOptions):
    num_experts: int = option(4, "r: petals (routed experts) per layer", low=2)
    act_ratio: float = option(0.05, "rho_act: share of channels in each token's activation set (not a paper value: "
                                    "its App. D.2 uses k_act = 7-14 of 14,336 channels; chosen by "
                                    "benchmarks/bench_more_sweep.py on calibration text)", low=0.0, high=1.0,
                              low_open=True)
    share_ratio: float | None = option(None, "rho_share: backbone share; default: solved from target_pr",
                                       low=0.0, high=1.0, low_open=True)
    alpha: float = option(0.0, "alpha of the activation energy |h_E| / |E|^alpha (Eq. 9; the paper gives no value; "
                               "chosen by benchmarks/bench_more_sweep.py)", low=0.0, high=1.0)
    layers: str = option("middle-deep", "middle-deep | uniform | early-middle | a list like 1,2,3")
    target_pr: float | None = option(0.2, "target pruning rate PR = 1 - APR (Eq. 17); none with share_ratio",
                                     low=0.0, high=1.0, low_open=True)
    calib_samples: int = option(100, "calibration sequences (§D.1: 100 is enough)", low=1)
    seq_len: int = option(256, "calibration sequence length", low=2)
    min_size_ratio: float = option(0.5, "smallest petal / mean petal size (§E.5)", low=0.0, high=1.0, low_open=True)
    max_size_ratio: float = option(1.5, "largest petal / mean petal size (§E.5)", low=1.0)
    variant: Literal["full", "backbone", "random", "random_petals", "naive"] = option(
        "full", "ablation (Tables 6, 10, 11): random = MoRE-Random (random routing); random_petals = random "
                "petals of the same sizes, routed as MoRE")

    def validate(self) -> None:
        if (self.share_ratio is None) == (self.target_pr is None):
            raise OptionError(f"share_ratio={self.share_ratio} and target_pr={self.target_pr}: set exactly one "
                              "(target_pr=none to fix share_ratio yourself)")
        if self.act_ratio == 1.0:
            raise OptionError("act_ratio=1.0 is out of range; allowed: (0, 1)")

    def check(self, model_config: PreTrainedConfig) -> None:
        m, context = model_config.intermediate_size, model_config.max_position_embeddings
        candidate_layers(self.layers, model_config.num_hidden_layers)  # raises on a bad list
        if self.num_experts > m - 1:
            raise OptionError(f"num_experts={self.num_experts} must be <= the non-shared channels ({m - 1})")
        require_at_most("seq_len", self.seq_len, context, "the model's context")

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        return self.calib_samples, self.seq_len


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """``target_pr = 1 - apr`` on the default middle-deep layers, or on every layer when those cannot
    reach it."""
    every = ",".join(map(str, range(adapter.num_layers)))
    return [{"target_pr": 1 - apr}, {"target_pr": 1 - apr, "layers": every}], f"target_pr={1 - apr:.3f}"
