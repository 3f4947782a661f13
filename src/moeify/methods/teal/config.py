"""TEAL's options: the target sparsity of every projection's inputs and the calibration that sets the
thresholds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeify.options import MethodOptions, method_config, option, require_at_most

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from moeify.arch import DecoderAdapter


@method_config
class TealConfig(MethodOptions):
    sparsity: float = option(0.5, "fraction of every projection's inputs zeroed (TEAL's uniform model-wide level; "
                                  "its paper reports 40-50%)", low=0.0, high=0.99)
    calib_samples: int = option(8, "calibration sequences", low=1)
    seq_len: int | None = option(None, "calibration sequence length (default: min(2048, model context))", low=2)

    def check(self, model_config: PreTrainedConfig) -> None:
        require_at_most("seq_len", self.seq_len, model_config.max_position_embeddings, "the model's context")

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        return self.calib_samples, self.seq_len or min(2048, model_config.max_position_embeddings)


def match_budget(apr: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """Every attention and MLP weight is a column of some thresholded projection, so APR ~ 1 - sparsity
    (biases, always active, keep it a little above)."""
    sparsity = round(1.0 - apr, 4)
    return [{"sparsity": sparsity}], f"sparsity={sparsity}"
