"""What ``convert`` and ``recover`` return and ``save`` writes, and the record entries both measure alike."""

from __future__ import annotations

import resource
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from moeify.evaluation.perplexity import Perplexity, relative_change
from moeify.planning import GIB, MemoryPlan


@dataclass
class ConversionResult:
    """The converted model, its record (``ConversionRecord.as_dict()``), and ``artifacts``: extra files
    (name -> bytes, e.g. PNG plots) that ``save`` writes next to the model."""

    model: PreTrainedModel
    tokenizer: Any
    record: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    artifacts: dict[str, bytes] = field(default_factory=dict)
    layer_files: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # layer by layer: the
    # converted layers' files (the model reads them), removed with the result


def quality_metrics(dense: Perplexity, converted: Perplexity) -> dict[str, Any]:
    """The record's ``metrics``: both perplexities, and the relative change with the evaluation text's
    sampling error of it (paired over windows)."""
    change, stderr = relative_change(dense, converted)
    return {"dense_ppl": dense.ppl, "ppl": converted.ppl, "eval_tokens": converted.tokens, "ppl_change": change,
            "ppl_change_stderr": stderr, "dense_eval": dense.as_dict(), "eval": converted.as_dict()}


def memory_record(plan: MemoryPlan, device: str) -> dict[str, Any]:
    """The record's ``memory``: the plan's peak beside the process's peak resident memory and, on CUDA, the
    device's peak allocation."""
    return {"plan_gib": round(plan.peak / GIB, 2), "plan_phase": plan.peak_phase,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "peak_device_gib": round(torch.cuda.max_memory_allocated() / GIB, 2)
            if torch.device(device).type == "cuda" else None}
