"""``convert`` and ``save``: a dense model turned into an MoE model by a registered method, measured against
the dense model in the same run, and written atomically. Returns values, prints nothing."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from moeify.api.recover import method_refit, recovery_identity, run_recovery
from moeify.api.result import ConversionResult, memory_record, quality_metrics
from moeify.arch import family_for
from moeify.calibration.corpus import Corpus, read_corpus
from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, TextSource, check_enough_text, read_text
from moeify.dtypes import dtype_name
from moeify.evaluation.perplexity import Perplexity, perplexity
from moeify.evaluation.record import RECORD_NAME, ConversionRecord, library_versions, write_record
from moeify.evaluation.speed import SPEED_SHAPE, forward_speed, speed_record
from moeify.export.model_card import model_card
from moeify.export.native import save_native
from moeify.files import atomic_dir, check_free_disk, check_output_dir
from moeify.loading import check_device, converted_method, load_config, load_model, working_dtype
from moeify.memory_plan import check_fits, method_plan
from moeify.methods import DEFAULT_METHOD, METHODS, Conversion, ConversionContext, Method, method_configs
from moeify.methods.attention_sparsity import AttentionSparsityOptions, threshold_attention
from moeify.moe.accounting import activated_parameters, nominal_activated_parameters, paper_ratio, tracking_routing
from moeify.moe.routing import routing_summary
from moeify.offload import layered_of
from moeify.options import OptionError
from moeify.planning import MemoryPlan, ModelShape
from moeify.sources import EMBEDDED_MODEL, model_source
from moeify.training.distributed import fsdp, world_size
from moeify.training.loop import earlier_seconds
from moeify.training.recovery_options import RecoveryOptions

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

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
                       measure_speed: bool, progress: bool,
                       known: Perplexity | None = None) -> tuple[Perplexity, tuple[float, float] | None]:
    """The model's perplexity (``known`` where it was measured on this text and window already) and speed."""
    if known is not None and (known.sha256, known.seq_len) == (eval_source.sha256, seq_len):
        ppl = known
    else:
        with tracking_routing(model):
            ppl = perplexity(model, tokenizer, eval_source, seq_len, progress=progress)
    speed = forward_speed(model, *SPEED_SHAPE) if measure_speed else None
    return ppl, speed


@dataclass(frozen=True)
class _Request:
    """A conversion as asked for, validated: everything that can be checked before a weight is read."""

    model: str | Path | None
    spec: Method
    config: Any
    recovery: RecoveryOptions
    attention: AttentionSparsityOptions
    model_config: PreTrainedConfig
    calib: Corpus
    evals: list[TextSource]
    seq_len: int
    layer_by_layer: bool
    measure_speed: bool
    warnings: list[str]

    @property
    def trains(self) -> bool:
        return self.config.training(self.model_config) is not None


def _validated(model: str | Path | None, method: str, options: dict[str, Any] | None,
               calib: str | Path | list[str | Path] | None, eval: str | Path | list[str | Path] | None,
               eval_seq_len: int | None, device: str, layer_by_layer: bool, measure_speed: bool) -> _Request:
    spec, config, recovery, attention = method_configs(method, options)
    calib_source = read_corpus(calib or EMBEDDED_CALIB)
    eval_sources = [read_text(e) for e in (eval if isinstance(eval, list) else [eval or EMBEDDED_EVAL])]
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
    if isinstance(calib_source, TextSource):
        check_enough_text(calib_source, *config.calibration_windows(model_config))
    recovery.check(model_config)
    context = model_config.max_position_embeddings
    seq_len = context if eval_seq_len is None else eval_seq_len
    if not 2 <= seq_len <= context:
        raise OptionError(f"eval_seq_len={seq_len} is out of range; allowed: [2, {context}] (the model's context)")
    check_device(device)
    request = _Request(model, spec, config, recovery, attention, model_config, calib_source, eval_sources, seq_len,
                       layer_by_layer, measure_speed and not layer_by_layer, warnings)
    if layer_by_layer:
        _check_layer_by_layer(request)
    return request


def _planned(request: _Request, dtype: str | None, device: str, check_memory: bool,
             out: str | Path | None) -> MemoryPlan:
    """The peak-memory plan, refused at once where it does not fit the device or the output's disk."""
    gguf = model_source(request.model).gguf_file is not None
    memory = method_plan(ModelShape.from_config(request.model_config, str(request.model or EMBEDDED_MODEL)),
                         request.spec, request.config, working_dtype(dtype, None if gguf else request.model_config),
                         request.seq_len, device, gguf, request.layer_by_layer,
                         len(request.evals[0].text) // CHARS_PER_TOKEN, world_size() if fsdp() else 1,
                         request.recovery, request.attention)
    if check_memory:
        check_fits(memory, device, request.spec.layer_by_layer and not request.trains)
    if out is not None:
        check_free_disk(Path(out), memory.output_bytes, "the converted model")
    return memory


def _converted(request: _Request, ctx: ConversionContext, work_dir: str | Path | None
               ) -> tuple[Conversion, float, tempfile.TemporaryDirectory | None]:
    """The method's conversion, its wall time (a resumed run: its whole time) and, layer by layer, the folder
    of the converted layers' files (until ``save`` writes the model)."""
    start = time.perf_counter()
    if not request.layer_by_layer:
        conversion = request.spec.run(ctx, request.config)
        return conversion, time.perf_counter() - start + earlier_seconds(conversion.details), None
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="moeify-layers-", dir=work_dir)
    with layered_of(ctx.model).writing(Path(scratch.name)):
        conversion = request.spec.run(ctx, request.config)
    return conversion, time.perf_counter() - start + earlier_seconds(conversion.details), scratch


def _recovered(request: _Request, moe: PreTrainedModel, tokenizer: Any, *, dtype: str | None, seed: int,
               device: str, work_dir: Path | None, milestones: tuple[int, ...], teacher_cache: str | Path | None,
               progress: bool) -> tuple[PreTrainedModel, dict[str, Any]]:
    """After the method's own training, a distillation from the dense model (``moeify.api.recover``): the
    recovered model and the record's ``recovery`` block, with the measurements before it under
    ``pre_recovery``."""
    eval_source = request.evals[0]
    with tracking_routing(moe):
        before = perplexity(moe, tokenizer, eval_source, request.seq_len, progress=progress)
    pre = {"ppl": before.ppl, "eval": before.as_dict(), "active": activated_parameters(moe, measured=True).as_dict()}
    teacher, _ = load_model(request.model, device, dtype)
    moe, recovered = run_recovery(moe, tokenizer, teacher, request.calib, request.recovery,
                                  identity=recovery_identity(request.model), eval_source=eval_source,
                                  seq_len=request.seq_len, seed=seed, device=device, work_dir=work_dir,
                                  cache_dir=None if teacher_cache is None else Path(teacher_cache),
                                  milestones=milestones, progress=progress,
                                  refit=method_refit(request.spec, request.config, request.attention, tokenizer,
                                                     request.calib, seed=seed, device=device, progress=progress))
    return moe, {**recovered, "pre_recovery": pre}


def convert(model: str | Path | None = None, method: str = DEFAULT_METHOD, options: dict[str, Any] | None = None, *,
            calib: str | Path | list[str | Path] | None = None, eval: str | Path | list[str | Path] | None = None,
            seed: int = 0, device: str = "cpu", dtype: str | None = None, eval_seq_len: int | None = None,
            measure_speed: bool = True, progress: bool = False, work_dir: str | Path | None = None,
            check_memory: bool = True, layer_by_layer: bool = False, recover_milestones: tuple[int, ...] = (),
            teacher_cache: str | Path | None = None, out: str | Path | None = None,
            dense_ppl: Perplexity | None = None) -> ConversionResult:
    """Convert a dense model with ``method`` and measure it against the dense model in the same run.

    ``calib``: the calibration/training text, a file, a folder or a list (large corpora are streamed from a
    cached token file; see ``moeify.calibration.corpus``). ``eval``: one held-out text, or several: the first
    is the one the metrics are measured on, and a method's analysis (e.g. DSMoE's per-data-set heatmap)
    covers them all. ``work_dir`` is where a method keeps state across runs (training checkpoints to resume
    from); the CLI uses ``<out>.work`` beside the output folder. ``dtype``: the working dtype (default: the
    checkpoint's own; see ``moeify.loading``). ``check_memory``: refuse at once a conversion whose estimated
    peak (``moeify.planning``) exceeds the device's free memory, naming what would make it fit.
    ``layer_by_layer``: for models larger than memory (training-free methods, a local safetensors checkpoint):
    the weights are read one decoder layer at a time, each converted layer is written to its own file (in
    ``work_dir``, else a temporary folder the result owns) and the dense and MoE perplexities are computed
    layer by layer over cached hidden states (``moeify.offload``); no speed is measured (that needs the
    whole model). ``recover_*`` options add a recovery after the method's own work (``moeify.api.recover``): its
    perplexity is also measured after each of ``recover_milestones`` tokens, and ``teacher_cache`` is where
    a top-k teacher cache is kept (default: ``work_dir``; ``moeify compare`` shares one among its methods).
    ``out``: where the result will be saved; its disk must have room for the saved model. ``dense_ppl``: the
    dense model's perplexity where the caller measured it already, in the same dtype on the same device
    (``moeify compare`` does, once for all its runs); used when its text and window are this run's.
    Everything that can be validated is validated before the model's weights are loaded."""
    request = _validated(model, method, options, calib, eval, eval_seq_len, device, layer_by_layer, measure_speed)
    torch.manual_seed(seed)
    memory = _planned(request, dtype, device, check_memory, out)
    dense, tokenizer = load_model(model, device, dtype, layer_by_layer)
    eval_source, seq_len, speed = request.evals[0], request.seq_len, request.measure_speed
    dense_quality, dense_speed = _quality_and_speed(dense, tokenizer, eval_source, seq_len, speed, progress,
                                                    known=dense_ppl)
    work = None if work_dir is None else Path(work_dir)
    ctx = ConversionContext(dense, tokenizer, request.calib, seed, torch.device(device), progress, work)
    conversion, convert_s, scratch = _converted(request, ctx, work_dir)
    moe, recovery = conversion.model.eval(), None
    details, timings = conversion.details, {"convert_s": convert_s}
    if request.attention.enabled:
        start = time.perf_counter()
        details = {**details, "attention_sparsity": threshold_attention(replace(ctx, model=moe), request.attention)}
        timings["attention_s"] = time.perf_counter() - start
    if request.recovery.enabled:
        moe, recovery = _recovered(request, moe, tokenizer, dtype=dtype, seed=seed, device=device, work_dir=work,
                                   milestones=recover_milestones, teacher_cache=teacher_cache, progress=progress)
    quality, speed_after = _quality_and_speed(moe, tokenizer, eval_source, seq_len, speed, progress)
    routing = routing_summary(moe)  # the evaluation pass tracked the routing
    measured = activated_parameters(moe, measured=True)
    nominal = nominal_activated_parameters(moe)
    if recovery is not None:
        timings["recover_s"] = recovery["wall_s"]
    artifacts = {**_routing_artifacts(routing), **conversion.artifacts}
    if request.spec.analyze is not None:  # after the common measurements: analyses may re-route and re-measure
        start = time.perf_counter()
        analysis = request.spec.analyze(replace(ctx, model=moe), request.config, request.evals, seq_len)
        details, artifacts = {**details, "analysis": analysis.details}, {**artifacts, **analysis.artifacts}
        timings["analysis_s"] = time.perf_counter() - start
    record = ConversionRecord(
        method=request.spec.name, paper=request.spec.paper, model=str(model or EMBEDDED_MODEL),
        config={**vars(request.config), **vars(request.attention), "seed": seed, "device": device,
                "layer_by_layer": layer_by_layer, "dtype": dtype_name(next(dense.parameters()).dtype),
                "processes": world_size(), "fsdp": fsdp()},
        data={"calib": {"name": request.calib.name, "sha256": request.calib.sha256},
              "eval": {"name": eval_source.name, "sha256": eval_source.sha256},
              "analysis_eval": [{"name": s.name, "sha256": s.sha256} for s in request.evals]},
        metrics=quality_metrics(dense_quality, quality), active=measured.as_dict(),
        paper_ratio=paper_ratio(moe, measured, request.spec.paper_ratio),
        nominal_active=None if nominal is None else nominal.as_dict(), routing=routing,
        speed=None if speed_after is None else speed_record(dense_speed, speed_after, *SPEED_SHAPE),
        timings=timings, memory=memory_record(memory, device), artifacts=sorted(artifacts), details=details,
        pre_recovery=None if recovery is None else recovery.pop("pre_recovery"), recovery=recovery,
        versions=library_versions(), warnings=request.warnings)
    return ConversionResult(moe, tokenizer, record.as_dict(), request.warnings, artifacts, scratch)


def _check_layer_by_layer(request: _Request) -> None:
    """A layer-by-layer conversion needs a method that touches the model only a layer at a time."""
    spec = request.spec
    if request.attention.enabled:
        raise OptionError("attention_sparsity thresholds the converted model's attention as a whole, so it cannot "
                          "run layer by layer")
    if request.recovery.enabled:
        raise OptionError("a recovery (recover_tokens) trains the whole model, so it cannot run layer by layer; "
                          "recover the saved conversion with moeify recover on a machine it fits")
    able = ", ".join(method.name for method in METHODS if method.layer_by_layer)
    if not spec.layer_by_layer:
        raise OptionError(f"method {spec.name!r} cannot convert layer by layer (it trains or analyses the whole "
                          f"model); methods that can: {able}")
    if request.trains:
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
