"""What every method gets (a conversion context) and what it registers (a ``Method``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from moeify.arch import DecoderAdapter
from moeify.calibration.data import TextSource


@dataclass
class ConversionContext:
    """The dense model being converted in place, and the shared inputs of every method.

    ``work_dir``: where a method may keep state across runs (training checkpoints), or None.
    ``artifacts``: files (name -> bytes, e.g. PNG plots) a method wants written next to the model."""

    model: PreTrainedModel
    tokenizer: Any
    calib: TextSource
    seed: int
    device: torch.device
    progress: bool = True
    work_dir: Path | None = None
    artifacts: dict[str, bytes] = field(default_factory=dict)

    @property
    def adapter(self) -> DecoderAdapter:
        return DecoderAdapter(self.model)


@dataclass(frozen=True)
class Method:
    """A registered conversion method: its paper, its typed config and its conversion function.

    ``convert(ctx, config)`` turns ``ctx.model`` into an MoE model in place and returns the
    method-specific part of the record (statistics). ``analyze(ctx, config, eval_sources, seq_len)``,
    if any, runs on the converted model and the held-out evaluation texts after the common evaluation
    and returns the record's ``details.analysis`` (it may add ``ctx.artifacts``); it never trains."""

    name: str
    paper: str
    summary: str
    config_cls: type
    convert: Callable[[ConversionContext, Any], dict[str, Any]]
    analyze: Callable[[ConversionContext, Any, list[TextSource], int], dict[str, Any]] | None = None

    def check(self, config: Any, model_config: PreTrainedConfig) -> None:
        """Model-dependent validation (e.g. ``top_k`` against the expert count), before heavy work."""
        config.check(model_config)
