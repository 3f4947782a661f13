"""CMoE's options: S/A/E (or the SxAyEz shorthand), ATopK's K_a, calibration and light fine-tuning. They are
the options of a carving (``CarvingOptions``), which the random-split baseline shares with its partition
fixed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from moeify.moe.experts.refit_options import RefitOptions
from moeify.options import OptionError, Shorthand, method_config, option, require_at_most
from moeify.training.lora_options import LoraOptions

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter

_SPEC = re.compile(r"^S(\d+)A(\d+)E(\d+)$")


def expand_spec(spec: str) -> dict[str, int]:
    """``S1A1E8`` -> num_shared 1, top_k 1, num_experts 8."""
    match = _SPEC.match(spec)
    if not match:
        raise OptionError(f"spec={spec!r} must look like S1A1E8 (shared, activated, total experts)")
    shared, active, total = map(int, match.groups())
    return {"num_shared": shared, "top_k": active, "num_experts": total}


SPEC = Shorthand("spec", "shorthand for S/A/E, e.g. S1A1E8 (= 25% of the MLP active)", expand_spec, after="top_k")


@dataclass(frozen=True)
class CarvingOptions(LoraOptions, RefitOptions):
    """The carving of every MLP into shared and routed experts with CMoE's representative-neuron router."""

    shorthands: ClassVar[tuple[Shorthand, ...]] = (SPEC,)
    num_experts: int = option(8, "E: total experts per layer, shared included", low=2)
    num_shared: int = option(1, "S: shared (always-on) experts", low=0)
    top_k: int = option(1, "A: routed experts activated per token", low=1)
    ka: int = option(10, "K_a of ATopK (Eq. 5): neurons marked active per token", low=1)
    calib_samples: int = option(8, "calibration sequences", low=1)
    seq_len: int | None = option(None, "calibration sequence length (default: min(2048, model context))", low=2)
    max_iter: int = option(100, "balanced k-means iterations at most", low=1)
    partition: Literal["balanced_kmeans", "random"] = option("balanced_kmeans", "expert grouping; random = LLaMA-MoE split")
    router_score: Literal["abs", "signed"] = option(
        "abs", "what ranks the experts: |h_R| of each representative neuron (Eq. 20-26 rank by the expected |h|; "
               "the official code) or the signed h_R")
    analysis: bool = option(True, "per layer, the MLP output error of the router's choice, of the best experts "
                                  "per token (oracle) and of static pruning at the same share, on calibration tokens")
    bias_speed: float = option(0.001, "gamma: load-balancing bias update speed (Eq. 33)", low=0.0)
    u_lr: float = option(1e-3, "learning rate of the score scale u", low=0.0, low_open=True)

    def validate(self) -> None:
        self.check_lora()
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

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        return self.calib_samples, self.effective_seq_len(model_config)


@method_config
class CmoeConfig(CarvingOptions):
    """CMoE's options: the carving options at the paper's defaults."""


# expert counts the budget matcher considers: the paper's E = 8 and 16 and the multiples of 4 between and up
# to 32, so that a share like 1/3 is met exactly by few large experts (S2A2E12: 128-neuron experts on a
# 1536-wide MLP), which run faster than many small ones at the same share (S5A6E32) for the same quality
EXPERT_COUNTS = (8, 12, 16, 20, 24, 28, 32)


def spec_for_share(mlp_share: float) -> str:
    """The SxAyEz closest to ``mlp_share`` = (S+A)/E, preferring fewer experts, then S = A."""
    best = min(((s, a, e) for e in EXPERT_COUNTS for s in range(1, e) for a in range(1, e - s + 1)),
               key=lambda sae: (round(abs((sae[0] + sae[1]) / sae[2] - mlp_share), 4), sae[2], abs(sae[0] - sae[1])))
    return f"S{best[0]}A{best[1]}E{best[2]}"


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """The S/A/E spec (E in ``EXPERT_COUNTS``, S and A as equal as possible) whose MLP share (S+A)/E is closest
    to the share that activated-parameter ratio ``apr`` needs."""
    from moeify.moe.accounting import mlp_share_for_apr

    share = mlp_share_for_apr(apr, adapter)
    spec = spec_for_share(share)
    return [{"spec": spec}], f"spec={spec} (MLP share {share:.3f} needed)"
