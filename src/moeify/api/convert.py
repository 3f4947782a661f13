"""``convert`` and ``save``: a dense model turned into an MoE model by a registered method, measured against
the dense model in the same run, and written atomically. Returns values, prints nothing."""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from moeify.api.recover import recovery_identity, run_recovery
from moeify.api.result import ConversionResult
from moeify.arch import family_for
from moeify.calibration.corpus import read_corpus
from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, TextSource, check_enough_text, read_text
from moeify.evaluation.perplexity import Perplexity, perplexity, relative_change
from moeify.evaluation.record import RECORD_NAME, library_versions, write_record
from moeify.evaluation.speed import SPEED_SHAPE, forward_speed, speed_record
from moeify.export.model_card import model_card
from moeify.export.native import save_native
from moeify.files import atomic_dir, check_free_disk, check_output_dir
from moeify.loading import check_device, converted_method, load_config, load_model, working_dtype
from moeify.memory_plan import check_fits, method_plan
from moeify.methods import DEFAULT_METHOD, METHODS, Calibrated, ConversionContext, Method, method_configs
from moeify.moe.accounting import activated_parameters, nominal_activated_parameters, paper_ratio, tracking_routing
from moeify.moe.routing import routing_summary
from moeify.offload import layered_of
from moeify.options import OptionError
from moeify.planning import GIB, ModelShape
from moeify.sources import EMBEDDED_MODEL, model_source
from moeify.training.distributed import fsdp, world_size
from moeify.training.loop import earlier_seconds
from moeify.training.recovery_options import RecoveryOptions

CHARS_PER_TOKEN = 3  # for the memory plan's count of evaluation tokens: English BPE averages 4 or more


def _routing_artifacts(routing: list[dict[str, Any]]) -> dict[str, bytes]:
    """The per-layer routing JSD plot (MoRE Fig. 2 style) for any model with routed layers."""
    if not routing:
        return {}
    from moeify.plots import per_layer_bars

    labels = [entry["layer"].split(".")[-2] if "." in entry["layer"] else entry["layer"] for entry in routing]
    png = per_layer_bars(labels, [entry["jsd"] for entry in routing], ylabel="JSD to uniform (bits)",
                         title="Routing JSD from uniform (Eq. 18)")
    return {"routing_jsd.png": png}


def _quality_and_speed(model: PreTrainedModel, tokenizer: Any, eval_source: TextSource, seq_len: int,
                       measure_speed: bool, progress: bool) -> tuple[Perplexity, tuple[float, float] | None]:
    with tracking_routing(model):
        ppl = perplexity(model, tokenizer, eval_source, seq_len, progress=progress)
    speed = forward_speed(model, *SPEED_SHAPE) if measure_speed else None
    return ppl, speed


def convert(model: str | Path | None = None, method: str = DEFAULT_METHOD, options: dict[str, Any] | None = None, *,
            calib: str | Path | list[str | Path] | None = None, eval: str | Path | list[str | Path] | None = None,
            seed: int = 0, device: str = "cpu", dtype: str | None = None, eval_seq_len: int | None = None,
            measure_speed: bool = True, progress: bool = False, work_dir: str | Path | None = None,
            check_memory: bool = True, layer_by_layer: bool = False, recover_milestones: tuple[int, ...] = (),
            teacher_cache: str | Path | None = None, out: str | Path | None = None) -> ConversionResult:
    """Convert a dense model with ``method`` and measure it against the dense model in the same run.

    ``calib``: the calibration/training text, a file, a folder or a list (large corpora are streamed from a
    cached token file; see ``moeify.calibration.corpus``). ``eval``: one held-out text, or several: the first is the one the metrics are measured on, and a
    method's analysis (e.g. DSMoE's per-data-set heatmap) covers them all.
    ``work_dir`` is where a method keeps state across runs (training checkpoints to resume from); the
    CLI uses ``<out>.work`` beside the output folder. ``dtype``: the working dtype (default: the
    checkpoint's own; see ``moeify.loading``). ``check_memory``: refuse at once a conversion whose estimated
    peak (``moeify.planning``) exceeds the device's free memory, naming what would make it fit.
    ``layer_by_layer``: for models larger than memory (training-free methods, a local safetensors checkpoint):
    the weights are read one decoder layer at a time, each converted layer is written to its own file (in
    ``work_dir``, else a temporary folder the result owns) and the dense and MoE perplexities are computed
    layer by layer over cached hidden states (``moeify.offload``); no speed is measured (that needs the
    whole model). ``recover_*`` options add a recovery after the method's own work (``moeify.api.recover``): its
    perplexity is also measured after each of ``recover_milestones`` tokens, and ``teacher_cache`` is where
    a top-k teacher cache is kept (default: ``work_dir``; ``moeify compare`` shares one among its methods).
    ``out``: where the result will be saved; its disk must have room for the saved model.
    Everything that can be validated is validated before the model's weights are loaded."""
    spec, config, recovery = method_configs(method, options)
    calib_source = read_corpus(calib or EMBEDDED_CALIB)
    eval_sources = [read_text(e) for e in (eval if isinstance(eval, list) else [eval or EMBEDDED_EVAL])]
    eval_source = eval_sources[0]
    warnings = [f"the calibration and evaluation texts are identical ({calib_source.name}): the perplexity is "
                "measured on calibration data and will look better than it is"
                for source in eval_sources if source.sha256 == calib_source.sha256]
    converted = converted_method(model)
    if converted is not None:
        raise ValueError(f"{model}: moeify converted this model already ({converted}); convert the dense model it "
                         "came from")
    model_config = load_config(model)
    family_for(model_config)
    spec.check(config, model_config)
    if isinstance(config, Calibrated) and isinstance(calib_source, TextSource):
        check_enough_text(calib_source, *config.calibration_windows(model_config))
    recovery.check(model_config)
    if layer_by_layer:
        _check_layer_by_layer(spec, config, recovery)
        measure_speed = False
    context = model_config.max_position_embeddings
    seq_len = context if eval_seq_len is None else eval_seq_len
    if not 2 <= seq_len <= context:
        raise OptionError(f"eval_seq_len={seq_len} is out of range; allowed: [2, {context}] (the model's context)")

    check_device(device)
    torch.manual_seed(seed)
    gguf = model_source(model).gguf_file is not None
    memory = method_plan(ModelShape.from_config(model_config, str(model or EMBEDDED_MODEL)), spec, config,
                         working_dtype(dtype, None if gguf else model_config), seq_len, device, gguf,
                         layer_by_layer, len(eval_source.text) // CHARS_PER_TOKEN, world_size() if fsdp() else 1,
                         recovery)
    if check_memory:
        check_fits(memory, device, spec.layer_by_layer and not getattr(config, "finetunes", False))
    if out is not None:
        check_free_disk(Path(out), memory.output_bytes, "the converted model")
    dense, tokenizer = load_model(model, device, dtype, layer_by_layer)
    dense_quality, dense_speed = _quality_and_speed(dense, tokenizer, eval_source, seq_len, measure_speed, progress)
    ctx = ConversionContext(dense, tokenizer, calib_source, seed, torch.device(device), progress,
                            work_dir=None if work_dir is None else Path(work_dir))
    start = time.perf_counter()
    scratch = None
    if layer_by_layer:  # the converted layers' files, until ``save`` writes the model
        if work_dir is not None:
            Path(work_dir).mkdir(parents=True, exist_ok=True)
        scratch = tempfile.TemporaryDirectory(prefix="moeify-layers-", dir=work_dir)
        with layered_of(dense).writing(Path(scratch.name)):
            details = spec.run(ctx, config)
    else:
        details = spec.run(ctx, config)
    convert_s = time.perf_counter() - start + earlier_seconds(details)  # a resumed run: its whole time
    moe = ctx.model.eval()
    recovered = None
    if recovery.enabled:  # after the method's own training: a distillation from the dense model
        with tracking_routing(moe):
            before = perplexity(moe, tokenizer, eval_source, seq_len, progress=progress)
        pre = {"ppl": before.ppl, "eval": before.as_dict(), "active": activated_parameters(moe, measured=True).as_dict()}
        teacher, _ = load_model(model, device, dtype)
        moe, recovered = run_recovery(moe, tokenizer, teacher, calib_source, recovery,
                                      identity=recovery_identity(model), eval_source=eval_source,
                                      seq_len=seq_len, seed=seed, device=device, work_dir=ctx.work_dir,
                                      cache_dir=None if teacher_cache is None else Path(teacher_cache),
                                      milestones=recover_milestones, progress=progress)
        del teacher
        recovered["pre_recovery"] = pre
        ctx.model = moe  # the analyses below read the recovered model
    quality, speed = _quality_and_speed(moe, tokenizer, eval_source, seq_len, measure_speed, progress)
    routing = routing_summary(moe)  # the evaluation pass tracked the routing
    measured = activated_parameters(moe, measured=True)
    active = measured.as_dict()
    nominal = nominal_activated_parameters(moe)
    timings = {"convert_s": convert_s, **({} if recovered is None else {"recover_s": recovered["wall_s"]})}
    if spec.analyze is not None:  # after the common measurements: analyses may re-route and re-measure
        start = time.perf_counter()
        details["analysis"] = spec.analyze(ctx, config, eval_sources, seq_len)
        timings["analysis_s"] = time.perf_counter() - start
    artifacts = {**_routing_artifacts(routing), **ctx.artifacts}
    # the relative change and the evaluation text's sampling error of it (paired over windows)
    ppl_change, ppl_change_stderr = relative_change(dense_quality, quality)
    record = {
        "method": spec.name,
        "paper": spec.paper,
        "model": str(model or EMBEDDED_MODEL),
        "config": {**vars(config), "seed": seed, "device": device, "layer_by_layer": layer_by_layer,
                   "dtype": str(next(dense.parameters()).dtype).removeprefix("torch."),
                   "processes": world_size(), "fsdp": fsdp()},
        "data": {"calib": {"name": calib_source.name, "sha256": calib_source.sha256},
                 "eval": {"name": eval_source.name, "sha256": eval_source.sha256},
                 "analysis_eval": [{"name": s.name, "sha256": s.sha256} for s in eval_sources]},
        "metrics": {"dense_ppl": dense_quality.ppl, "ppl": quality.ppl, "eval_tokens": quality.tokens,
                    "ppl_change": ppl_change, "ppl_change_stderr": ppl_change_stderr,
                    "dense_eval": dense_quality.as_dict(), "eval": quality.as_dict()},
        "active": active,
        "paper_ratio": paper_ratio(moe, measured, spec.paper_ratio),
        "nominal_active": None if nominal is None else nominal.as_dict(),
        "routing": routing,
        "speed": None if speed is None else speed_record(dense_speed, speed, *SPEED_SHAPE),
        "timings": timings,
        "memory": {"plan_gib": round(memory.peak / GIB, 2), "plan_phase": memory.peak_phase,
                   "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                   "peak_device_gib": round(torch.cuda.max_memory_allocated() / GIB, 2)
                   if torch.device(device).type == "cuda" else None},
        "artifacts": sorted(artifacts),
        "details": details,
        **({} if recovered is None else {"pre_recovery": recovered.pop("pre_recovery"), "recovery": recovered}),
        "versions": library_versions(),
        "warnings": warnings,
    }
    return ConversionResult(moe, tokenizer, record, warnings, artifacts, scratch)


def _check_layer_by_layer(spec: Method, config: Any, recovery: RecoveryOptions) -> None:
    """A layer-by-layer conversion needs a method that touches the model only a layer at a time."""
    if recovery.enabled:
        raise OptionError("a recovery (recover_tokens) trains the whole model, so it cannot run layer by layer; "
                          "recover the saved conversion with moeify recover on a machine it fits")
    able = ", ".join(method.name for method in METHODS if method.layer_by_layer)
    if not spec.layer_by_layer:
        raise OptionError(f"method {spec.name!r} cannot convert layer by layer (it trains or analyses the whole "
                          f"model); methods that can: {able}")
    if getattr(config, "finetunes", False):
        raise OptionError(f"{spec.name}'s fine-tune trains the whole model, so it cannot run layer by layer; "
                          "leave the finetune options unset")


def save(result: ConversionResult, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the converted model, its tokenizer, ``record.json`` and a model card (``README.md``) atomically
    into ``out``."""
    out = Path(out)
    check_output_dir(out, overwrite)
    with atomic_dir(out, overwrite=overwrite, command="recover" if "recovery" in result.record else "convert") as tmp:
        save_native(result.model, tmp, result.tokenizer, method=result.record["method"])
        write_record(result.record, tmp / RECORD_NAME)
        (tmp / "README.md").write_text(model_card(result.record))
        for name, content in result.artifacts.items():
            (tmp / name).write_bytes(content)
    return out
