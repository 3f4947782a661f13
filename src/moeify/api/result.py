"""What ``convert`` and ``recover`` return and ``save`` writes."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel


@dataclass
class ConversionResult:
    """The converted model, its record, and ``artifacts``: extra files (name -> bytes, e.g. PNG plots)
    that ``save`` writes next to the model."""

    model: PreTrainedModel
    tokenizer: Any
    record: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    artifacts: dict[str, bytes] = field(default_factory=dict)
    layer_files: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # layer by layer: the
    # converted layers' files (the model reads them), removed with the result
