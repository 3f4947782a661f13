"""``recover``: a converted model distilled from its dense model for a budget of tokens
(``moeify.training.recovery``), as the last stage of ``convert`` (``--set recover_tokens=N``) or for a saved
conversion (``moeify recover RUN``). The record keeps what the conversion measured before the recovery
(``pre_recovery``), beside the recovery's tokens, wall time, trainable parameters, loss curve and the
perplexity after each milestone. A method whose budget is a calibration of the weights (``Method.refit``: TEAL's
thresholds, DSMoE's matched tau), and the attention thresholds of ``attention_sparsity``, are calibrated again
after the recovery, so that the recovered model holds the budget it was converted at; the milestones'
perplexities are measured before that, at the conversion's calibration. Returns values, prints nothing."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from moeify.api.result import ConversionResult, memory_record, quality_metrics
from moeify.calibration.corpus import Corpus, read_corpus
from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, TextSource, read_text, token_stream
from moeify.evaluation.perplexity import Perplexity, perplexity
from moeify.evaluation.record import read_conversion_record
from moeify.evaluation.speed import SPEED_SHAPE, forward_speed, speed_record
from moeify.loading import load_config, load_model, working_dtype
from moeify.memory_plan import check_fits, recovery_memory
from moeify.methods import get_method
from moeify.methods.base import ConversionContext, Method
from moeify.methods.attention_sparsity import AttentionSparsityOptions, attention_options, refit_attention
from moeify.moe.accounting import ActiveParams, activated_parameters, paper_ratio, tracking_routing
from moeify.options import OptionError, build_config, require_work_dir_for_resume
from moeify.planning import MethodMemory, ModelShape, plan_memory
from moeify.sources import EMBEDDED_MODEL
from moeify.training.recovery import recover, teacher_cache
from moeify.training.recovery_options import RecoveryOptions

SEED_OFFSET = 2  # the recovery's windows are drawn apart from the method's own training (seed + 1)
Refit = Callable[[PreTrainedModel], "dict[str, Any] | None"]  # a recovered model's budget calibrated again


def recovery_identity(teacher: str | Path | None) -> dict[str, Any]:
    """What names a recovery's teacher in its checkpoints' fingerprint and its cache's key."""
    return {"teacher": str(teacher or EMBEDDED_MODEL)}


def routed_perplexity(model: PreTrainedModel, tokenizer: Any, source: TextSource,
                      seq_len: int) -> tuple[Perplexity, ActiveParams]:
    """The perplexity on ``source`` and the activated parameters its tokens were routed to."""
    with tracking_routing(model):
        ppl = perplexity(model, tokenizer, source, seq_len)
    return ppl, activated_parameters(model, measured=True)


def run_recovery(model: PreTrainedModel, tokenizer: Any, teacher: PreTrainedModel, calib: Corpus,
                 options: RecoveryOptions, *, identity: dict[str, Any], eval_source: TextSource, seq_len: int,
                 seed: int, device: str, work_dir: Path | None, cache_dir: Path | None = None,
                 milestones: tuple[int, ...] = (), progress: bool = False,
                 refit: Refit | None = None) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Recover ``model`` from the dense ``teacher`` on ``calib``; the perplexity on ``eval_source``, and the APR
    routed on it, are measured after each of ``milestones`` tokens below the budget (before any ``refit``: a
    method whose share follows the weights, TEAL's thresholds or DSMoE's gates, drifts from its target until
    the refit at the end). ``identity`` names the teacher for checkpoints and
    caches; ``refit`` (``method_refit``) calibrates the recovered model's budget again. Returns (the recovered
    model, the record's ``recovery`` block)."""
    require_work_dir_for_resume(options.recover_resume, work_dir)
    teacher.eval().requires_grad_(False)
    student = model  # LoRA adapters, while they train, sit inside this model

    def evaluate(_tokens: int) -> dict[str, Any]:
        ppl, active = routed_perplexity(student, tokenizer, eval_source, seq_len)
        return {"ppl": ppl.ppl, "nll": ppl.nll, "apr": active.apr}

    start = time.perf_counter()
    model, summary = recover(model, teacher, token_stream(calib, tokenizer), options, seed=seed + SEED_OFFSET,
                             device=torch.device(device), identity={**identity, "text": calib.sha256},
                             work_dir=work_dir, cache_dir=cache_dir,
                             milestones=tuple(m for m in milestones if m < options.recover_tokens),
                             on_milestone=evaluate, progress=progress)
    if refit is not None and (entry := refit(model)) is not None:
        summary["refit"] = entry
    wall_s = time.perf_counter() - start + summary["earlier_seconds"]  # a resumed recovery: its whole time
    return model, {**summary, "wall_s": wall_s, "options": vars(options),
                   "calib": {"name": calib.name, "sha256": calib.sha256}}


def method_refit(method: Method, config: Any, attention: AttentionSparsityOptions, tokenizer: Any, calib: Corpus, *,
                 seed: int, device: str, progress: bool = False) -> Refit | None:
    """``method``'s refit of a recovered model, and the attention thresholds' (``attention``), on the conversion's
    text and seed (its calibration windows); None where nothing is calibrated on the weights."""
    if method.refit is None and not attention.enabled:
        return None

    def refit(model: PreTrainedModel) -> dict[str, Any] | None:
        ctx = ConversionContext(model, tokenizer, calib, seed, torch.device(device), progress)
        entry = None if method.refit is None else method.refit(ctx, config)
        if attention.enabled:
            entry = {**(entry or {}), "attention_sparsity": refit_attention(ctx, attention)}
        return entry

    return refit


def prepare_teacher_cache(teacher: PreTrainedModel, tokenizer: Any, calib: Corpus,
                          options: RecoveryOptions, *, identity: dict[str, Any], seed: int, cache_dir: Path,
                          device: str, progress: bool = False) -> Path:
    """Build, before any recovery runs, the top-k teacher cache that ``run_recovery`` with these arguments
    reads (``moeify compare`` does, so that methods recovered side by side share one teacher pass)."""
    seq_len = options.seq_len(teacher.config)
    return teacher_cache(teacher.eval(), token_stream(calib, tokenizer), options, options.plan(seq_len, wrap=True),
                         seed=seed + SEED_OFFSET, identity={**identity, "text": calib.sha256}, cache_dir=cache_dir,
                         device=torch.device(device), progress=progress)


def _rereadable(entry: dict[str, str], embedded: str, given: Any, what: str) -> Any:
    """The text a run was measured on when ``given`` is None: the embedded one it names, else an error."""
    if given is not None:
        return given
    if read_text(embedded).sha256 == entry["sha256"]:
        return embedded
    raise OptionError(f"the run's {what} text was {entry['name']!r} (sha256 {entry['sha256'][:12]}...); moeify "
                      f"keeps only its name: pass it again with --{what}")


def recover_run(run: str | Path, options: dict[str, Any], *, calib: str | Path | list[str | Path] | None = None,
                eval: str | Path | None = None, teacher: str | Path | None = None, seed: int | None = None,
                device: str = "cpu", dtype: str | None = None, eval_seq_len: int | None = None,
                measure_speed: bool = True,
                work_dir: Path | None = None, milestones: tuple[int, ...] = (),
                progress: bool = False) -> ConversionResult:
    """Recover the saved conversion in ``run`` (a folder ``moeify convert`` wrote) from its base model (or
    ``teacher``); returns a ``ConversionResult`` whose record is the run's with the metrics, activated
    parameters and speed measured again after the recovery against the dense model in this process, and
    the run's own measurements kept under ``pre_recovery``. The options, the texts and the run are checked
    before a weight is read."""
    run = Path(run)
    record = read_conversion_record(run)
    config = build_config(RecoveryOptions, options)
    if not config.enabled:
        raise OptionError("recover needs a budget: --tokens N (recover_tokens) > 0")
    calib_source = read_corpus(_rereadable(record.data["calib"], EMBEDDED_CALIB, calib, "calib"))
    eval_source = read_text(_rereadable(record.data["eval"], EMBEDDED_EVAL, eval, "eval"))
    teacher = teacher or record.model
    seed = record.config.get("seed", 0) if seed is None else seed
    seq_len = eval_seq_len or record.metrics["eval"]["seq_len"]
    base = load_config(teacher)
    config.check(base)
    memory = plan_memory(ModelShape.from_config(base, str(teacher)), MethodMemory(),
                         working_dtype(dtype or record.config.get("dtype"), None), seq_len,
                         on_cpu=torch.device(device).type == "cpu", mapped=False,
                         recovery=recovery_memory(ModelShape.from_config(base, str(teacher)), config))
    check_fits(memory, device)
    model, tokenizer = load_model(run, device, dtype)
    dense, _ = load_model(teacher, device, next(model.parameters()).dtype)
    dense_quality = perplexity(dense, tokenizer, eval_source, seq_len)
    before, active_before = routed_perplexity(model, tokenizer, eval_source, seq_len)
    method = get_method(record.method)
    refit = method_refit(method, _method_config(method, record.config), attention_options(record.config), tokenizer,
                         calib_source, seed=record.config.get("seed", 0), device=device, progress=progress)
    model, block = run_recovery(model, tokenizer, dense, calib_source, config, identity=recovery_identity(teacher),
                                eval_source=eval_source, seq_len=seq_len, seed=seed, device=device,
                                work_dir=work_dir, milestones=milestones, progress=progress, refit=refit)
    after, measured = routed_perplexity(model, tokenizer, eval_source, seq_len)
    speed = None if not measure_speed else speed_record(
        forward_speed(dense.eval(), *SPEED_SHAPE), forward_speed(model.eval(), *SPEED_SHAPE), *SPEED_SHAPE)
    new = dataclasses.replace(
        record, metrics=quality_metrics(dense_quality, after), active=measured.as_dict(),
        paper_ratio=paper_ratio(model, measured, method.paper_ratio),
        data={**record.data, "eval": {"name": eval_source.name, "sha256": eval_source.sha256}},
        speed=speed, memory=memory_record(memory, device), recovery=block,
        pre_recovery={"ppl": before.ppl, "eval": before.as_dict(), "active": active_before.as_dict(),
                      "metrics": record.metrics})
    return ConversionResult(model, tokenizer, new.as_dict())


def _method_config(method: Method, recorded: dict[str, Any]) -> Any:
    """The method's options as the run's record keeps them (beside the run's own settings: seed, device, ...)."""
    names = {field.name for field in dataclasses.fields(method.config_cls)}
    return build_config(method.config_cls, {key: value for key, value in recorded.items() if key in names})
