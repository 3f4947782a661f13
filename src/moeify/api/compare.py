"""``moeify compare``: every method on the same calibration and evaluation text at a matched activated-
parameter ratio (APR over attention + MLP projections, MoRE Eq. 16), then one report.

Each method says how it is matched (``Method.match_budget``: the option sets to try in order), or why
it cannot be (``Method.unmatched``; it then runs with its defaults and the report shows the APR it
reached). An existing ``--out`` is refused unless ``--resume`` (complete runs of the options asked now are
kept, the others run) or ``--overwrite`` (moeify's own earlier comparison is replaced whole).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from moeify.api.convert import convert, save
from moeify.api.recover import prepare_teacher_cache, recovery_identity
from moeify.arch import DecoderAdapter
from moeify.calibration.corpus import read_corpus
from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, read_text
from moeify.evaluation.perplexity import perplexity
from moeify.evaluation.record import read_record
from moeify.files import OutputExistsError, atomic_file, check_output_dir, moeify_files, write_marker
from moeify.loading import load_model
from moeify.methods import Method, get_method
from moeify.methods.attention_sparsity import ATTENTION_KEYS, attention_options
from moeify.moe.accounting import attention_share
from moeify.options import build_config
from moeify.recipes import Recipe
from moeify.recipes.table import recipe_table, row_results
from moeify.training.recovery_options import RecoveryOptions


RECIPE_TABLE = "recipe.md"


def matched_options(method: Method, active: float, adapter: DecoderAdapter) -> tuple[list[dict[str, Any]], str]:
    """Option sets to try in order for ``method`` at APR ``active``, and how it was matched."""
    if method.match_budget is None:
        return [{}], f"not matched: {method.unmatched}"
    return method.match_budget(active, adapter)


# what a comparison writes beside its runs (and <row>.work)
WORKING = ("teacher_cache", "compare.json", RECIPE_TABLE)


def prepare_output(out: Path, *, overwrite: bool, resume: bool) -> None:
    """Before any work: an existing ``out`` is continued (``resume``), cleared of what an earlier comparison
    wrote (``overwrite``: its runs and report, each marked as moeify's, and its working files; anything else
    stays), or refused; then the folder is marked as moeify's."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite are alternatives: continue the runs in --out, or replace them")
    if resume and out.is_dir() and moeify_files(out) is None:
        raise OutputExistsError(f"{str(out)!r} was not written by moeify compare; nothing to resume")
    if not resume:
        check_output_dir(out, overwrite)  # refuses a folder moeify did not write
        if out.is_dir() and overwrite:
            for child in out.iterdir():
                if child.is_dir() and (moeify_files(child) is not None or child.name in WORKING
                                       or child.name.endswith(".work")):
                    shutil.rmtree(child)
                elif child.name in WORKING:
                    child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "compare", files={})  # its runs carry their own markers


def _holds(config: dict[str, Any], config_cls: type, asked: dict[str, Any]) -> bool:
    """Whether a record's ``config`` holds the options ``asked`` of ``config_cls``, compared as parsed since
    ``--set`` gives strings."""
    try:
        parsed = build_config(config_cls, asked)
    except ValueError:
        return False
    return all(config.get(key) == getattr(parsed, key) for key in asked if hasattr(parsed, key))


def _kept_options(method: str, attempts: list[dict[str, Any]], options: dict[str, Any],
                  recovery: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The options of a completed run in ``folder`` that a resumed comparison keeps: those of the first of
    ``attempts`` (with ``options`` over it) that the run's record holds, with the recovery ``recovery`` asks
    for (or none); None where no record exists or it holds other options, so that run is converted again."""
    if not (folder / "record.json").is_file():
        return None
    record = read_record(folder)
    recovered = record.get("recovery")
    recovers = bool(recovery.get("recover_tokens"))
    if recovers != bool(recovered) or (recovers and not _holds(recovered["options"], RecoveryOptions, recovery)):
        return None
    config_cls = get_method(method).config_cls

    def holds(asked: dict[str, Any]) -> bool:
        return (_holds(record["config"], config_cls, {k: v for k, v in asked.items() if k not in ATTENTION_KEYS})
                and attention_options(record["config"]) == attention_options(asked))

    return next((asked for asked in ({**matched, **options} for matched in attempts) if holds(asked)), None)


def _resume_flags(method: Method, work: Path) -> dict[str, Any]:
    """The options that continue a method's interrupted run from its checkpoints in ``work``: ``resume`` where
    the method trains and left checkpoints, ``recover_resume`` where a recovery did."""
    from moeify.training.checkpoint import last_checkpoint
    from moeify.training.recovery import CHECKPOINTS

    flags: dict[str, Any] = {}
    if "resume" in {f.name for f in dataclasses.fields(method.config_cls)} and last_checkpoint(work) is not None:
        flags["resume"] = True
    if last_checkpoint(work, only=CHECKPOINTS) is not None:
        flags["recover_resume"] = True
    return flags


@dataclass(frozen=True)
class MethodRun:
    """What converting one method of a comparison needs (picklable: it may run in a worker process)."""

    method: str
    name: str  # its folder in ``out``: the method's name, or a recipe's row
    attempts: list[dict[str, Any]]
    matched: str
    settings: dict[str, Any]  # convert's keyword arguments shared by every method
    options: dict[str, Any]  # options beside (and over) the matched ones: the method's own, then the recovery's
    recovery: dict[str, Any]
    out: Path
    resume: bool


def _run_method(run: MethodRun, threads: int | None = None) -> dict[str, Any]:
    """Convert (and recover) one method into ``out/<method>``, trying its option sets in order; its summary."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    summary: dict[str, Any] = {"method": run.method, "row": run.name, "matched": run.matched}
    folder, work = run.out / run.name, run.out / f"{run.name}.work"
    kept = _kept_options(run.method, run.attempts, run.options, run.recovery, folder) if run.resume else None
    if kept is not None:
        summary.update(options=kept, folder=str(folder), resumed=True)
        return summary
    for matched in run.attempts:
        asked = {**matched, **run.options}
        continuing = _resume_flags(get_method(run.method), work) if run.resume else {}
        try:
            result = convert(method=run.method, options={**asked, **run.recovery, **continuing}, work_dir=work,
                             **run.settings)
        except ValueError as error:  # e.g. a budget this method cannot reach with these options
            summary["error"] = str(error)
            continue
        summary.update(options=asked, folder=str(save(result, folder, overwrite=True)))
        summary.pop("error", None)
        shutil.rmtree(work, ignore_errors=True)
        break
    return summary


def _runs(methods: list[str], active: float, adapter: DecoderAdapter, recipe: Recipe | None,
          options: dict[str, dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]], str]]:
    """(method, row name, option sets to try, how they were chosen) of every conversion: each method matched
    to APR ``active`` (its own budget to what the attention thresholds of its ``options`` leave it), or each row
    of ``recipe`` with its options."""
    if recipe is not None:
        return [(row.method, row.name, [row.options], f"{recipe.source}: {row.label}") for row in recipe.runs]
    runs = []
    for method in methods:
        asked = options.get(method, {})
        thresholds = attention_options(asked)
        if not thresholds.enabled:
            runs.append((method, method, *matched_options(get_method(method), active, adapter)))
            continue
        own = thresholds.apr_for_method(active, attention_share(adapter))
        attempts, how = matched_options(get_method(method), own, adapter)
        runs.append((method, method, attempts, f"{how} (APR {own:.3f} with the attention whole; attention "
                                               f"thresholded at {thresholds.attention_sparsity})"))
    return runs


def run_comparison(model: str | None, methods: list[str], active: float, out: Path, *,
                   calib: str | list[str] | None = None,
                   eval: str | None = None, seed: int = 0, device: str = "cpu", dtype: str | None = None,
                   progress: bool = False, overwrite: bool = False, resume: bool = False,
                   options: dict[str, dict[str, Any]] | None = None, recovery: dict[str, Any] | None = None,
                   recover_tokens: tuple[int, ...] = (), eval_seq_len: int | None = None,
                   jobs: int = 1, recipe: Recipe | None = None) -> list[dict[str, Any]]:
    """Convert with every method into ``out/<method>`` and write ``out/report``; returns one summary per
    method (its folder, the options used, how they were matched, or the error that stopped it). With
    ``resume``, methods whose run in ``out`` is complete are not run again. ``options``: a method's own
    options beside (and over) the matched ones. ``recover_tokens``: recover every conversion for the
    largest of these budgets (``recovery``: the recovery's other options), its perplexity measured after
    each smaller one; where the recovery distils top-k targets, their cache (``out/teacher_cache``) is built
    once, first, for every method. ``jobs``: methods converted at a time, each in its own process with an
    equal share of the CPU threads. ``recipe``: convert its rows, each with its options, into ``out/<row>``
    (``options`` then keyed by row) in place of ``methods`` at ``active``, and write ``out/recipe.md``, the
    rows beside the paper's figures."""
    from moeify.report.build import write_report

    prepare_output(out, overwrite=overwrite, resume=resume)
    dense, tokenizer = load_model(model, device, dtype)
    adapter = DecoderAdapter(dense)
    recovery = dict(recovery or {})
    settings = {"model": model, "calib": calib, "eval": eval, "seed": seed, "device": device, "dtype": dtype,
                "eval_seq_len": eval_seq_len, "progress": progress and jobs == 1,
                "recover_milestones": tuple(sorted(recover_tokens)), "teacher_cache": out / "teacher_cache"}
    if recover_tokens:
        recovery["recover_tokens"] = max(recover_tokens)
        config = build_config(RecoveryOptions, recovery)
        distils = config.recover_lm_share < 1  # the LM loss alone needs no teacher
        if distils and config.recover_top_k and len(methods) > 1 and config.recover_teacher in ("auto", "cache"):
            recovery["recover_teacher"] = "cache"  # one teacher pass for every method's recovery
            prepare_teacher_cache(dense, tokenizer, read_corpus(calib or EMBEDDED_CALIB), config,
                                  identity=recovery_identity(model), seed=seed, cache_dir=out / "teacher_cache",
                                  device=device, progress=progress)
    planned = _runs(methods, active, adapter, recipe, options or {})
    row_options = {name: (options or {}).get(name, {}) for _, name, _, _ in planned}
    if not (resume and all(_kept_options(method, attempts, row_options[name], recovery, out / name) is not None
                           for method, name, attempts, _ in planned)):
        # the dense perplexity once for every run (each run still times the dense model beside its own)
        settings["dense_ppl"] = perplexity(dense, tokenizer, read_text(eval or EMBEDDED_EVAL),
                                           eval_seq_len or dense.config.max_position_embeddings, progress=progress)
    runs = [MethodRun(method, name, attempts, how, settings, row_options[name], recovery, out, resume)
            for method, name, attempts, how in planned]
    del dense
    if jobs == 1:
        summaries = [_run_method(run) for run in runs]
    else:
        threads = max(1, torch.get_num_threads() // jobs)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            summaries = list(pool.map(partial(_run_method, threads=threads), runs))
    done = [Path(s["folder"]) for s in summaries if "folder" in s]
    if done:
        write_report(done, out / "report", overwrite=True)
    if recipe is not None:
        with atomic_file(out / RECIPE_TABLE) as tmp:
            tmp.write_text(recipe_table(recipe, row_results(summaries), str(model or "the embedded stories260K")))
    return summaries
