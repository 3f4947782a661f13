"""TEAL's options: the target sparsity of every projection's inputs and the calibration that sets the
thresholds; and its thresholds on the attention of any MoE conversion (``attention_sparsity``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from moeify.options import MethodOptions, build_config, method_config, option, require_at_most

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


@method_config
class AttentionSparsityOptions:
    """TEAL's thresholds on the attention of any MoE conversion (``convert --set attention_sparsity=S``): an MoE
    keeps the attention whole, so at an APR it leaves its MLPs the rest of the budget; TEAL zeroes the small
    inputs of every projection. With the attention's inputs thresholded at S, the attention frees S of its
    share, which ``moeify compare`` gives the MLP (``apr_for_method``). The thresholds are TEAL's (its rule and
    calibration windows), set after the method's conversion and calibrated again after a recovery."""

    attention_sparsity: float = option(
        0.0, "fraction of the attention projections' inputs zeroed after the conversion, by TEAL's magnitude "
             "thresholds (0: the attention whole); for methods that keep the attention whole", low=0.0, high=0.99)

    @property
    def enabled(self) -> bool:
        return self.attention_sparsity > 0

    def calibration(self) -> TealConfig:
        return TealConfig(sparsity=self.attention_sparsity)

    def apr_for_method(self, apr: float, attention_share: float) -> float:
        """The APR a method's own budget must reach (its attention counted whole) for the model to land at
        ``apr`` once the thresholds free ``attention_sparsity`` of the attention's share."""
        return apr + self.attention_sparsity * attention_share


ATTENTION_KEYS = frozenset(f.name for f in dataclasses.fields(AttentionSparsityOptions))


def attention_options(options: dict[str, Any]) -> AttentionSparsityOptions:
    """The attention thresholds' options among ``options`` (``--set`` pairs or a record's config; the others
    ignored): a record from before the option holds none, the attention whole."""
    return build_config(AttentionSparsityOptions, {k: v for k, v in options.items() if k in ATTENTION_KEYS})
