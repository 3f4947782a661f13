"""The static-pruning baseline's options: the activated-parameter ratio, attention pruning, calibration, and
the optional LoRA fine-tune (the same budget a fine-tuned method gets)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from moeify.moe.experts.refit_options import RefitOptions
from moeify.options import method_config, option, require_at_most
from moeify.training.lora_options import LoraOptions

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter


@method_config
class StaticPruneConfig(LoraOptions, RefitOptions):
    active_ratio: float = option(0.5, "activated-parameter ratio to keep (APR over attention + MLP projections)",
                                 low=0.0, high=1.0, low_open=True)
    attention: Literal["on", "off"] = option("on", "also prune attention head dimensions (off = MLP channels "
                                                   "only; unsupported attention falls back to off)")
    calib_samples: int = option(8, "calibration sequences", low=1)
    seq_len: int | None = option(None, "calibration sequence length (default: min(2048, model context))", low=2)

    def validate(self) -> None:
        self.check_lora()

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        return self.calib_samples, self.seq_len or min(2048, model_config.max_position_embeddings)


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """The ratio is the option itself: ``active_ratio = apr``."""
    return [{"active_ratio": apr}], f"active_ratio={apr}"
