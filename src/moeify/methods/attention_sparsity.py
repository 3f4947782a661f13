"""TEAL's thresholds on the attention of any MoE conversion (``attention_sparsity``): the stage the use cases run
after a method's conversion, and again after a recovery moved the weights. The options and the rule are TEAL's
(its package); this module is what the use cases see of them."""

from __future__ import annotations

from typing import Any

from moeify.methods.base import ConversionContext
from moeify.methods.teal.config import ATTENTION_KEYS, AttentionSparsityOptions, attention_options
from moeify.methods.teal.convert import refit, threshold_attention


def refit_attention(ctx: ConversionContext, options: AttentionSparsityOptions) -> dict[str, Any]:
    """The attention thresholds of a recovered model calibrated again (each projection at its own sparsity)."""
    return refit(ctx, options.calibration())


__all__ = ["ATTENTION_KEYS", "AttentionSparsityOptions", "attention_options", "refit_attention", "threshold_attention"]
