"""``moeify export`` as a library function: load a converted folder, (optionally) approximate what
no format computes, build the standard-format model, measure it, write it. Returns the record; prints nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, read_text
from moeify.evaluation.perplexity import perplexity
from moeify.evaluation.record import RECORD_NAME, library_versions
from moeify.export import gguf as gguf_export
from moeify.export.approximate import approximate as approximate_parts
from moeify.export.gguf.quantize import LLAMA_QUANTS
from moeify.export.hf_export import EXPORTERS, HfExport, HfExporter, NotExportable, Support, save_hf
from moeify.export.hf_parts import EXACT, Approximation
from moeify.files import check_not_an_input, check_output_dir, check_output_file
from moeify.loading import load_model

GGUF = "gguf"  # llama.cpp's one-file format, written through a standard format (``export.gguf``)
CALIB_SEQ_LEN = 512  # approximation windows (or the model's context, if shorter)
DISTILL_STEPS = 300  # optimiser steps of a fitted router


def exporter_named(name: str) -> HfExporter:
    if name not in EXPORTERS:
        raise ValueError(f"unknown export format {name!r}; available: {', '.join(EXPORTERS)}, {GGUF} "
                         "(the native format is what `moeify convert` writes)")
    return EXPORTERS[name]


def check_formats(source: str | Path, device: str = "cpu", dtype: str | None = None) -> list[Support]:
    """``supports(model, explain=True)`` of every format for the model in ``source``."""
    model, _ = load_model(source, device, dtype)
    return [exporter.supports(model, explain=True) for exporter in EXPORTERS.values()]


def parse_dense_layers(text: str) -> list[int] | str:
    """``--dense-layers``: ``auto`` or comma-separated layer indices."""
    if text.strip() == "auto":
        return "auto"
    try:
        return sorted({int(item) for item in text.split(",")})
    except ValueError:
        raise ValueError(f"--dense-layers={text!r} must be 'auto' or comma-separated layer indices "
                         "(e.g. 0,1)") from None


def export_folder(source: str | Path, fmt: str, out: str | Path, *, approximate: bool = False,
                  distill_steps: int | None = None, calib: str | Path | None = None, eval: str | Path | None = None,
                  seed: int = 0, overwrite: bool = False, device: str = "cpu", dtype: str | None = None,
                  dense_layers: list[int] | str | None = None, quant: str = "f16") -> dict[str, Any]:
    """Export the converted model in ``source`` to ``fmt`` in ``out`` (atomically).

    ``approximate``: replace what no format computes by its closest form (``export.approximate``; fitted
    routers take ``distill_steps`` optimiser steps, default ``DISTILL_STEPS``), chosen on ``calib``
    (default: the embedded calibration slice); the record then reports each part's agreement and the
    perplexity of source and export on ``eval`` (default: the embedded evaluation slice). ``dense_layers``
    (layer indices or ``"auto"``) exports those routed layers dense, an approximation too. The export is
    written in ``dtype`` (default: the dtype the source was saved in). ``fmt="gguf"`` writes one file for
    llama.cpp, in ``quant``, through the standard format ``gguf_route`` picks."""
    approximate = approximate or dense_layers is not None
    out = Path(out)
    _check_request(source, fmt, out, quant=quant, approximate=approximate, overwrite=overwrite,
                   texts=(calib, eval), distill_steps=distill_steps)
    model, tokenizer = load_model(source, device, dtype)
    record: dict[str, Any] = {"command": "export", "source": str(source), "versions": library_versions()}
    converted = Path(source) / RECORD_NAME
    if converted.is_file() and (dense := json.loads(converted.read_text()).get("model")):
        record["dense_model"] = dense  # what `moeify bench` compares the export with
    vocabulary = None
    if fmt == GGUF:
        fmt = gguf_route(model)
        _refuse_unsupported(fmt, model.config)
        places = [source, *([record["dense_model"]] if "dense_model" in record else [])]
        vocabulary = gguf_export.vocabulary(places, model.config.vocab_size)
    export = _built(exporter_named(fmt), model, tokenizer, record, approximate=approximate, dense_layers=dense_layers,
                    distill_steps=distill_steps, calib=calib, eval=eval, seed=seed, gguf=vocabulary is not None)
    if vocabulary is None:
        save_hf(export, out, tokenizer, overwrite=overwrite, record=record)
    else:
        _refuse_unsupported(export.format, export.model.config)  # what only the built export's config says
        record["gguf"] = {"quant": quant, "tokenizer": vocabulary.source}
        record["gguf"].update(gguf_export.write_gguf(export, out, vocabulary, quant, record))
    return {**export.record, **record}


def _refuse_unsupported(fmt: str, config: Any) -> None:
    if reasons := gguf_export.unsupported(fmt, config):
        raise NotExportable("llama.cpp would not compute this model as written:\n"
                            + "\n".join(f"  - {reason}" for reason in reasons))


def gguf_route(model: PreTrainedModel, approximation: Approximation = EXACT) -> str:
    """The standard format a GGUF file is written through: ``llama`` for a dense model; else ``mixtral``
    (llama.cpp's llama with experts) where it holds the routing exactly at no more neurons per token
    than the format chosen below: one routed product per layer, the shared part folded into every expert,
    where granitemoe runs a shared product beside the routed one, so fewer operations per token at the same
    multiply-accumulates (more bytes on disk: each expert holds the shared part); else ``granitemoeshared``
    where it holds the routing exactly, else ``qwen2_moe`` where that does (softmax weights not
    renormalised: Dense2MoE's), else ``granitemoeshared`` (through its approximation, or its refusal).
    With ``approximation`` (``--approximate``'s parts, fitted for the format this route picks without it),
    the same rule on what the approximation computes: CMoE's fitted top-1 routers go through ``mixtral``."""
    if EXPORTERS["llama"].supports(model, approximation=approximation):
        return "llama"
    for fmt in ("granitemoeshared", "qwen2_moe"):
        if (neurons := EXPORTERS[fmt].neurons_per_token(model, approximation)) is not None:  # fmt holds it
            folded = EXPORTERS["mixtral"].neurons_per_token(model, approximation)
            return "mixtral" if folded is not None and folded <= neurons else fmt
    return "granitemoeshared"


def _check_request(source: str | Path, fmt: str, out: Path, *, quant: str, approximate: bool, overwrite: bool,
                   texts: tuple[str | Path | None, str | Path | None], distill_steps: int | None) -> None:
    """Everything checkable before a weight is read: the format and quantisation, the approximation's
    options, the output (a folder, or for gguf a file) and the quantiser a k-quant needs."""
    if fmt == GGUF:
        if quant not in gguf_export.QUANTS:
            raise ValueError(f"--quant {quant!r} is not one of {', '.join(gguf_export.QUANTS)}")
    else:
        exporter_named(fmt)
        if quant != "f16":
            raise ValueError(f"--quant is the gguf format's; --format {fmt} is written in --dtype")
    if not approximate and (any(texts) or distill_steps is not None):
        raise ValueError("--calib, --eval and --distill-steps are the approximation's; they need --approximate "
                         "(or --dense-layers)")
    if fmt == GGUF:
        check_output_file(out, overwrite, [source, *texts], flag="--out")
        if quant in LLAMA_QUANTS:
            gguf_export.quantiser()
    else:
        check_not_an_input(out, [source, *texts])
        check_output_dir(out, overwrite)


def _built(exporter: HfExporter, model: PreTrainedModel, tokenizer: Any, record: dict[str, Any], *,
           approximate: bool, dense_layers: list[int] | str | None, distill_steps: int | None,
           calib: str | Path | None, eval: str | Path | None, seed: int, gguf: bool = False) -> HfExport:
    """The standard-format model; with ``approximate``, of the closest forms, whose agreement and perplexity
    change go to ``record["approximation"]``; for a GGUF file (``gguf``), in the format ``gguf_route``
    picks for the approximation."""
    named = Approximation(dense_layers=frozenset(dense_layers)) if isinstance(dense_layers, list) else EXACT
    if not approximate:
        return exporter.build(model)
    if not (support := exporter.supports(model, explain=True, approximation=named)) and not support.approximable:
        raise NotExportable(str(support))  # before the approximation's work; ``build`` checks the exact case
    calib_source, eval_source = read_text(calib or EMBEDDED_CALIB), read_text(eval or EMBEDDED_EVAL)
    seq_len = min(CALIB_SEQ_LEN, model.config.max_position_embeddings)
    steps = DISTILL_STEPS if distill_steps is None else distill_steps
    approximation, parts = approximate_parts(model, tokenizer, calib_source, eval_source, steps=steps,
                                             seq_len=seq_len, seed=seed, dense_layers=dense_layers or (),
                                             fmt=exporter.name)
    if gguf:
        exporter = EXPORTERS[gguf_route(model, approximation)]
    export = exporter.build(model, approximation=approximation)
    context = model.config.max_position_embeddings
    before = perplexity(model, tokenizer, eval_source, context).ppl
    after = perplexity(export.model, tokenizer, eval_source, context).ppl
    record["approximation"] = {
        "note": "the exported model is NOT the converted model: each part below is its closest form in the "
                "format, chosen on the calibration text",
        "calib": {"name": calib_source.name, "sha256": calib_source.sha256},
        "eval": {"name": eval_source.name, "sha256": eval_source.sha256},
        "parts": parts, "source_ppl": before, "export_ppl": after, "ppl_change": after - before}
    return export
