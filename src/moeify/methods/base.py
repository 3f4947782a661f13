"""What every method gets (a conversion context) and what it registers (a ``Method``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from moeify.arch import DecoderAdapter
from moeify.calibration.data import TextSource


@dataclass
class ConversionContext:
    """The dense model being converted in place, and the shared inputs of every method."""

    model: PreTrainedModel
    tokenizer: Any
    calib: TextSource
    seed: int
    device: torch.device
    progress: bool = True

    @property
    def adapter(self) -> DecoderAdapter:
        return DecoderAdapter(self.model)


@dataclass(frozen=True)
class Method:
    """A registered conversion method: its paper, its typed config and its conversion function.

    ``convert(ctx, config)`` turns ``ctx.model`` into an MoE model in place and returns the
    method-specific part of the record (statistics, analyses)."""

    name: str
    paper: str
    summary: str
    config_cls: type
    convert: Callable[[ConversionContext, Any], dict[str, Any]]

    def check(self, config: Any, model_config: PreTrainedConfig) -> None:
        """Model-dependent validation (e.g. ``top_k`` against the expert count), before heavy work."""
        config.check(model_config)
