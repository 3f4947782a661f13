"""``evaluate``: perplexity and zero-shot accuracy of any model (dense or converted), with the activated
ratios measured on the same data, and ``set_runtime_options`` (router options such as ``top_k`` and the
options a method registers). Returns values, prints nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from moeify.calibration.data import EMBEDDED_EVAL, read_text
from moeify.evaluation.harness import check_tasks, run_tasks
from moeify.evaluation.perplexity import perplexity
from moeify.methods import METHODS
from moeify.moe.accounting import activated_parameters, moe_layers, tracking_routing
from moeify.offload import layered_of
from moeify.options import OptionError


def set_runtime_options(model: PreTrainedModel, options: dict[str, Any]) -> Callable[[], None]:
    """Change a converted model's runtime options without converting again: its routers' (e.g.
    ``top_k``, ``tau``) and those a method registers (e.g. ToMoE's ``pseudo_moe``). Returns the function
    that puts every changed option back."""
    layers = moe_layers(model)
    if options and not layers:
        raise OptionError("runtime options (--set) apply to converted models only; this model has no MoE layers")
    method_options = {name: setter for method in METHODS for name, setter in method.runtime_options.items()}
    undo: list[Callable[[], None]] = []
    try:
        for name, value in options.items():
            if name in method_options:
                undo.append(method_options[name](model, value))
                continue
            for router in (layer.router for layer in layers if layer.router is not None):  # static layers: none
                previous = router.spec().get(name)
                router.set_option(name, value)
                undo.append(lambda router=router, name=name, previous=previous: router.set_option(name, previous))
    except BaseException:
        _run_all(undo)
        raise
    return lambda: _run_all(undo)


def _run_all(undo: list[Callable[[], None]]) -> None:
    for step in reversed(undo):
        step()


def evaluate(model: PreTrainedModel, tokenizer: Any, data: list[str | Path] | None = None, *,
             seq_len: int | None = None, runtime_options: dict[str, Any] | None = None,
             tasks: list[str] | None = None, task_data: str | Path | None = None, limit: int | None = None,
             batch_size: int = 16, protocol: str = "windows", stride: int | None = None) -> dict[str, Any]:
    """Perplexity per data file, zero-shot accuracy per lm-eval task (``tasks`` read from ``task_data``,
    see ``moeify.evaluation.harness``; ``limit`` items each), and the activated ratios measured on all of
    it. Without ``data`` the embedded evaluation slice is used, unless only tasks were asked for.
    ``protocol``/``stride``: see ``moeify.evaluation.perplexity``. ``runtime_options`` hold for this
    evaluation only: the model is given its own options back afterwards."""
    if tasks and layered_of(model) is not None:
        raise OptionError("zero-shot tasks need the whole model in memory; this one is held layer by layer "
                          "(its perplexity is computed layer by layer)")
    if tasks:
        check_tasks(tasks, task_data, limit)
    sources = [read_text(d) for d in (data or ([] if tasks else [EMBEDDED_EVAL]))]
    context = model.config.max_position_embeddings
    seq_len = context if seq_len is None else seq_len
    if not 2 <= seq_len <= context:
        raise OptionError(f"seq_len={seq_len} is out of range; allowed: [2, {context}] (the model's context)")
    results: dict[str, Any] = {"ppl": {}, "eval": {}}
    restore = set_runtime_options(model, runtime_options or {})
    try:
        with tracking_routing(model):
            for source in sources:
                ppl = perplexity(model, tokenizer, source, seq_len, protocol=protocol, stride=stride)
                results["ppl"][source.name] = ppl.ppl
                results["eval"][source.name] = ppl.as_dict()
            if tasks:
                harness = run_tasks(model, tokenizer, tasks, task_data, limit=limit, batch_size=batch_size)
                results["tasks"] = harness.scores
                results["harness"] = {"lm_eval": harness.lm_eval_version, "limit": limit,
                                      "task_data": str(Path(task_data).resolve())}
        active = activated_parameters(model, measured=True)
    finally:
        restore()
    results["active"] = {"mlp_ratio": active.mlp_ratio, "apr": active.apr, **active.as_dict()}
    results["runtime_options"] = runtime_options or {}
    return results
