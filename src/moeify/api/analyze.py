"""``moeify analyze``: a method's analysis of a dense model on its own, without converting it (today
Dense2MoE's inter-layer similarity, §2.2, Fig. 3: the only registered ``model_analysis``). Returns values;
``save_analysis`` writes the folder atomically."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeify.calibration.data import EMBEDDED_CALIB, calibration_batches, read_text
from moeify.evaluation.record import RECORD_NAME, library_versions, write_record
from moeify.files import atomic_dir, check_output_dir
from moeify.loading import load_model
from moeify.methods import METHODS, Method, get_method
from moeify.options import OptionError
from moeify.sources import EMBEDDED_MODEL


@dataclass
class LayerAnalysis:
    """The record (matrices, spans ranked as Dense2MoE's selection sees them, provenance) and the files
    (matrices JSON, heatmap PNGs) that ``save_analysis`` writes next to it."""

    record: dict[str, Any]
    artifacts: dict[str, bytes]


def analyzing_method(name: str | None) -> Method:
    """The method named ``name``, or the first registered one with a model analysis; it must have one."""
    if name is None:
        name = next((m.name for m in METHODS if m.model_analysis is not None), "")
    method = get_method(name)
    if method.model_analysis is None:
        offered = ", ".join(m.name for m in METHODS if m.model_analysis is not None)
        raise OptionError(f"method {name!r} has no analysis of a dense model; methods with one: {offered}")
    return method


def analyze_layers(model: str | Path | None = None, *, method: str | None = None, calib: str | Path | None = None,
                   samples: int = 8, seq_len: int | None = None, seed: int = 0, device: str = "cpu",
                   dtype: str | None = None, progress: bool = False) -> LayerAnalysis:
    """``method``'s analysis (default: the first method that offers one) of ``model`` (default: the
    embedded one) on ``samples`` windows of ``seq_len`` tokens (default min(1024, context)) drawn from
    ``calib``."""
    analysis = analyzing_method(method)
    source = read_text(calib or EMBEDDED_CALIB)
    if samples < 1:
        raise OptionError(f"samples={samples} is out of range; allowed: [1, inf)")
    loaded, tokenizer = load_model(model, device, dtype)
    context = loaded.config.max_position_embeddings
    seq_len = min(1024, context) if seq_len is None else seq_len
    if not 2 <= seq_len <= context:
        raise OptionError(f"seq_len={seq_len} is out of range; allowed: [2, {context}] (the model's context)")
    batches = calibration_batches(source, tokenizer, samples, seq_len, seed)
    entries, artifacts = analysis.model_analysis(loaded, batches, torch.device(device), progress)
    record = {
        "command": "analyze",
        "method": analysis.name,
        "model": str(model or EMBEDDED_MODEL),
        "config": {"samples": samples, "seq_len": seq_len, "seed": seed, "device": device,
                   "dtype": str(next(loaded.parameters()).dtype).removeprefix("torch.")},
        "data": {"calib": {"name": source.name, "sha256": source.sha256}},
        **entries,
        "artifacts": sorted(artifacts),
        "versions": library_versions(),
    }
    return LayerAnalysis(record, artifacts)


def save_analysis(result: LayerAnalysis, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the artifacts and ``record.json`` atomically into ``out``."""
    out = Path(out)
    check_output_dir(out, overwrite)
    with atomic_dir(out, overwrite=overwrite, command="analyze") as tmp:
        for name, content in result.artifacts.items():
            (tmp / name).write_bytes(content)
        write_record(result.record, tmp / RECORD_NAME)
    return out
