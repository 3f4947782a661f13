"""``moeify export`` as a library function: load a converted folder, (optionally) distill its routers,
build the standard-format model, measure it, write it. Returns the record; prints nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, read_text
from moeify.evaluation.perplexity import perplexity
from moeify.evaluation.record import RECORD_NAME, library_versions
from moeify.export.hf_distill import distill_routers
from moeify.export.hf_export import EXPORTERS, NotExportable, Support, distillable_layers, save_hf
from moeify.files import check_output_dir
from moeify.loading import load_model

CALIB_SEQ_LEN = 512  # distillation windows (or the model's context, if shorter)


def exporter_named(name: str):
    if name not in EXPORTERS:
        raise ValueError(f"unknown export format {name!r}; available: {', '.join(EXPORTERS)} "
                         "(the native format is what `moeify convert` writes)")
    return EXPORTERS[name]


def check_formats(source: str | Path, device: str = "cpu", dtype: str | None = None) -> list[Support]:
    """``supports(model, explain=True)`` of every format for the model in ``source``."""
    model, _ = load_model(source, device, dtype)
    return [exporter.supports(model, explain=True) for exporter in EXPORTERS.values()]


def export_folder(source: str | Path, fmt: str, out: str | Path, *, distill_steps: int | None = None,
                  calib: str | Path | None = None, eval: str | Path | None = None, seed: int = 0,
                  overwrite: bool = False, device: str = "cpu", dtype: str | None = None) -> dict[str, Any]:
    """Export the converted model in ``source`` to ``fmt`` in ``out`` (atomically).

    ``distill_steps``: replace non-linear routers by linear ones fitted to their decisions on ``calib``
    (default: the embedded calibration slice); the record then reports the decision agreement and the
    perplexity of source and export on ``eval`` (default: the embedded evaluation slice). The export is
    written in ``dtype`` (default: the dtype the source was saved in)."""
    exporter = exporter_named(fmt)
    if distill_steps is None and (calib or eval):
        raise ValueError("--calib and --eval are the distillation's texts; they need --distill-router STEPS")
    out = Path(out)
    check_output_dir(out, overwrite)
    calib_source, eval_source = read_text(calib or EMBEDDED_CALIB), read_text(eval or EMBEDDED_EVAL)
    model, tokenizer = load_model(source, device, dtype)
    support = exporter.supports(model, explain=True)
    if not support and not (support.distillable and distill_steps):
        raise NotExportable(str(support))
    record: dict[str, Any] = {"command": "export", "source": str(source), "versions": library_versions()}
    converted = Path(source) / RECORD_NAME
    if converted.is_file() and (dense := json.loads(converted.read_text()).get("model")):
        record["dense_model"] = dense  # what `moeify bench` compares the export with
    if distill_steps is None:
        export = exporter.build(model)
    else:
        paths = distillable_layers(model)
        if not paths:
            raise ValueError("--distill-router applies to non-linear routers; this model has none (its export "
                             "is exact without it)")
        seq_len = min(CALIB_SEQ_LEN, model.config.max_position_embeddings)
        distillation = distill_routers(model, tokenizer, paths, distill_steps, calib_source, eval_source,
                                       seq_len=seq_len, seed=seed)
        export = exporter.build(model, routings=distillation.routings)
        context = model.config.max_position_embeddings
        before = perplexity(model, tokenizer, eval_source, context).ppl
        after = perplexity(export.model, tokenizer, eval_source, context).ppl
        record["distillation"] = {
            "approximation": "linear routers fitted to the original routers' top-k decisions; the exported "
                             "model is NOT the converted model",
            "steps": distill_steps, "calib": {"name": calib_source.name, "sha256": calib_source.sha256},
            "eval": {"name": eval_source.name, "sha256": eval_source.sha256},
            "calib_agreement": distillation.mean_agreement("calib_agreement"),
            "held_out_agreement": distillation.mean_agreement("held_out_agreement"),
            "source_ppl": before, "export_ppl": after, "ppl_change": after - before,
            "layers": distillation.layers}
    save_hf(export, out, tokenizer, overwrite=overwrite, record=record)
    return {**export.record, **record}
