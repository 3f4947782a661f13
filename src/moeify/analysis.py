"""``moeify analyze``: a model's inter-layer similarity (Dense2MoE §2.2, Fig. 3) on its own, without
converting it. Returns values; ``save_analysis`` writes the folder atomically."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeify.api import EMBEDDED_MODEL, load_model
from moeify.calibration.data import EMBEDDED_CALIB, calibration_batches, read_text
from moeify.calibration.similarity import layer_similarity, similarity_heatmaps
from moeify.evaluation.record import RECORD_NAME, library_versions, write_record
from moeify.export.io import atomic_dir, check_output_dir
from moeify.methods.dense2moe_build import rank_spans
from moeify.methods.options import OptionError

SIMILARITY_NAME = "layer_similarity.json"


@dataclass
class LayerAnalysis:
    """The record (matrices, spans ranked as Dense2MoE's selection sees them, provenance) and the files
    (matrices JSON, heatmap PNGs) that ``save_analysis`` writes next to it."""

    record: dict[str, Any]
    artifacts: dict[str, bytes]


def analyze_layers(model: str | Path | None = None, *, calib: str | Path | None = None, samples: int = 8,
                   seq_len: int | None = None, seed: int = 0, device: str = "cpu",
                   progress: bool = False) -> LayerAnalysis:
    """S_L and S_M of ``model`` (default: the embedded one) on ``samples`` windows of ``seq_len`` tokens
    (default min(1024, context), as Dense2MoE's conversion) drawn from ``calib``."""
    source = read_text(calib or EMBEDDED_CALIB)
    if samples < 1:
        raise OptionError(f"samples={samples} is out of range; allowed: [1, inf)")
    loaded, tokenizer = load_model(model, device)
    context = loaded.config.max_position_embeddings
    seq_len = seq_len or min(1024, context)
    if not 2 <= seq_len <= context:
        raise OptionError(f"seq_len={seq_len} is out of range; allowed: [2, {context}] (the model's context)")
    batches = calibration_batches(source, tokenizer, samples, seq_len, seed)
    similarity = layer_similarity(loaded, batches, device=device, progress=progress)
    matrices = similarity.as_dict()
    artifacts = {SIMILARITY_NAME: (json.dumps(matrices, indent=1) + "\n").encode(), **similarity_heatmaps(similarity)}
    record = {
        "command": "analyze",
        "model": str(model or EMBEDDED_MODEL),
        "config": {"samples": samples, "seq_len": seq_len, "seed": seed, "device": device},
        "data": {"calib": {"name": source.name, "sha256": source.sha256}},
        "similarity": matrices,
        "spans": [s.as_dict() for s in rank_spans(similarity.layer_output, similarity.mlp_input)],
        "artifacts": sorted(artifacts),
        "versions": library_versions(),
    }
    return LayerAnalysis(record, artifacts)


def save_analysis(result: LayerAnalysis, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the artifacts and ``record.json`` atomically into ``out``."""
    out = Path(out)
    check_output_dir(out, overwrite)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        for name, content in result.artifacts.items():
            (tmp / name).write_bytes(content)
        write_record(result.record, tmp / RECORD_NAME)
    return out
