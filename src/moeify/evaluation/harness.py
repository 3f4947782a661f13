"""Zero-shot multiple-choice tasks through lm-evaluation-harness, on an in-memory model, fully offline.

The task definitions are moeify's own YAMLs in ``tasks/`` (named ``moeify_<task>`` so they never clash
with lm-eval's), in lm-eval's standard formulations. They read local files in the layout of
``../shared/assets/data`` (``TASKS`` below): for each run a small wrapper YAML in a temporary folder
``include``s the packaged one and adds ``dataset_kwargs`` with absolute ``data_files`` under
``task_data`` and a temporary datasets cache, so no path is hard-coded, nothing is downloaded and
nothing accumulates in ``~/.cache``. ``lm_eval`` is imported only when a task runs: ``import moeify``
stays light, and without lm-eval the error says what to install.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

INSTALL_HINT = "zero-shot tasks need lm-evaluation-harness: pip install -e \".[eval]\" (or pip install lm-eval)"


def join_piqa_labels(files: list[Path], scratch: Path) -> Path:
    """PIQA's release keeps the labels in a separate ``.lst`` (one 0/1 per line): write one JSONL whose
    rows carry them as ``label``, the field the task's ``doc_to_target`` reads."""
    docs_path, labels_path = files
    docs = [line for line in docs_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = labels_path.read_text(encoding="utf-8").split()
    if len(docs) != len(labels):
        raise ValueError(f"{docs_path} has {len(docs)} rows but {labels_path} has {len(labels)} labels")
    out = scratch / "piqa_labelled.jsonl"
    out.write_text("".join(json.dumps({**json.loads(doc), "label": int(label)}) + "\n"
                           for doc, label in zip(docs, labels)), encoding="utf-8")
    return out


@dataclass(frozen=True)
class TaskSpec:
    """A task's packaged YAML, the split its YAML evaluates (the ``data_files`` key must name it), its
    files relative to ``task_data``, and ``prepare`` when lm-eval cannot read them as they are."""

    yaml: str
    split: str
    files: tuple[str, ...]
    prepare: Callable[[list[Path], Path], Path] | None = None


TASKS: dict[str, TaskSpec] = {
    "arc_easy": TaskSpec("arc_easy.yaml", "test", ("arc/ARC-Easy-test.jsonl",)),
    "arc_challenge": TaskSpec("arc_challenge.yaml", "test", ("arc/ARC-Challenge-test.jsonl",)),
    "piqa": TaskSpec("piqa.yaml", "validation", ("piqa/valid.jsonl", "piqa/valid-labels.lst"), join_piqa_labels),
    "hellaswag": TaskSpec("hellaswag.yaml", "validation", ("hellaswag/hellaswag_val_subset1000.jsonl",)),
    "winogrande": TaskSpec("winogrande.yaml", "validation", ("winogrande/winogrande_dev_partial.jsonl",)),
}


@dataclass
class HarnessResult:
    """``scores[task]``: acc (and acc_norm where lm-eval defines it) with their standard errors and ``n``
    items; ``samples[task]`` (when asked for): per item, the choices' log-likelihoods and its metrics."""

    scores: dict[str, dict[str, float]]
    lm_eval_version: str
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def check_tasks(tasks: list[str], task_data: str | Path | None, limit: int | None = None) -> dict[str, list[Path]]:
    """Validate that lm-eval is installed, task names, ``limit`` and the local files before any model
    work; returns task -> files."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ImportError(INSTALL_HINT)
    if limit is not None and limit < 1:  # lm-eval would read a limit below 1 as a fraction of the items
        raise ValueError(f"limit={limit} is out of range; allowed: >= 1 (items per task)")
    unknown = [name for name in tasks if name not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; allowed: {', '.join(TASKS)}")
    if task_data is None:
        folders = ", ".join(sorted({file.split("/")[0] + "/" for spec in TASKS.values() for file in spec.files}))
        raise ValueError(f"tasks need --task-data DIR: a folder laid out like ../shared/assets/data ({folders})")
    files = {name: [Path(task_data) / f for f in TASKS[name].files] for name in tasks}
    for path in (p for paths in files.values() for p in paths):
        if not path.is_file():
            raise FileNotFoundError(f"task data file not found: {path}")
    return files


def _write_wrapper(name: str, files: list[Path], scratch: Path) -> None:
    """A task YAML that includes the packaged one and points it at the local data. Written as JSON,
    which is valid YAML, so no YAML writer is needed."""
    spec = TASKS[name]
    data = spec.prepare(files, scratch) if spec.prepare else files[0]
    packaged = resources.files("moeify.evaluation").joinpath("tasks", spec.yaml)
    wrapper = {"include": str(packaged), "task": f"moeify_{name}",
               "dataset_kwargs": {"data_files": {spec.split: str(data.resolve())},
                                  "cache_dir": str(scratch / "datasets_cache")}}
    (scratch / f"moeify_{name}.yaml").write_text(json.dumps(wrapper, indent=2) + "\n", encoding="utf-8")


def _scores(metrics: dict[str, Any], n: int) -> dict[str, float]:
    """lm-eval's ``"acc,none"``-style keys (metric, filter) -> ``{"acc": .., "acc_stderr": .., "n": ..}``."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        metric, _, filter_name = key.partition(",")
        if filter_name == "none" and metric.startswith("acc") and isinstance(value, (int, float)):
            out[metric] = float(value)  # stderr is the string "N/A" when lm-eval cannot compute it
    out["n"] = n
    return out


def _samples(logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"doc_id": s["doc_id"], "loglikelihoods": [float(ll) for ll, _ in s["filtered_resps"]],
             **{m: float(s[m]) for m in s["metrics"]}} for s in logged]


def run_tasks(model: Any, tokenizer: Any, tasks: list[str], task_data: str | Path, *, limit: int | None = None,
              batch_size: int = 16, samples: bool = False) -> HarnessResult:
    """Evaluate ``model`` zero-shot on ``tasks`` (names in ``TASKS``) with lm-eval's HFLM; ``limit`` keeps
    the first N items of each task (lm-eval's ``--limit``)."""
    files = check_tasks(tasks, task_data, limit)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="moeify-tasks-") as tmp:
        scratch = Path(tmp)
        for name, paths in files.items():
            _write_wrapper(name, paths, scratch)
        manager = TaskManager(include_path=str(scratch), include_defaults=False)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=[f"moeify_{name}" for name in files], limit=limit,
                                          task_manager=manager, log_samples=samples)
        except AssertionError as error:  # HFLM's sanity checks on each (context, continuation) pair
            raise ValueError(
                f"lm-eval rejected an item: most likely a choice longer than the model's context of "
                f"{lm.max_length} tokens (lm-eval truncates contexts, never choices; on stories260K: PIQA items "
                "314 and 1554); evaluate fewer items with --limit or use a model with a longer context") from error
    scores = {name: _scores(out["results"][f"moeify_{name}"], out["n-samples"][f"moeify_{name}"]["effective"])
              for name in files}
    logged = {name: _samples(out["samples"][f"moeify_{name}"]) for name in files} if samples else {}
    return HarnessResult(scores, lm_eval.__version__, logged)
