"""A recipe's rows as moeify measured them, beside the paper's figures, and whether the orderings agree."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import Any

from moeify.evaluation.record import read_record
from moeify.recipes import Recipe


def row_results(summaries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each run row's result, keyed by row name, from a comparison's summaries: the options it ran with (the
    recipe's and any ``--set`` beside them), APR, perplexity, the dense perplexity and the conversion time from
    its record; or the ``error`` that stopped it."""
    results = {}
    for summary in summaries:
        name = summary.get("row", summary["method"])
        if "folder" not in summary:
            results[name] = {"error": summary.get("error", "not run")}
            continue
        record = read_record(Path(summary["folder"]))
        results[name] = {"options": summary.get("options") or {}, "apr": record["active"]["apr"],
                         "ppl": record["metrics"]["ppl"], "dense_ppl": record["metrics"]["dense_ppl"],
                         "convert_s": record["timings"].get("convert_s")}
    return results


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if abs(value) < 1e5 else f"{value:.3g}"


def ordering(recipe: Recipe, measured: dict[str, dict[str, Any]]) -> str:
    """Whether moeify's perplexity ranks the rows it ran as the paper's ``metric`` ranks them: the pairs in
    the same order, and both orders when they differ."""
    rows = [row for row in recipe.runs if row.name in measured and recipe.metric in row.paper]
    if len(rows) < 2:
        return "Fewer than two rows have both moeify's perplexity and the paper's figure: no ordering to compare."
    ours = sorted(rows, key=lambda row: measured[row.name]["ppl"])
    sign = 1 if recipe.lower_is_better else -1
    theirs = sorted(rows, key=lambda row: sign * row.paper[recipe.metric])
    rank = {row.name: i for i, row in enumerate(theirs)}
    pairs = list(combinations(ours, 2))
    agree = sum(rank[a.name] < rank[b.name] for a, b in pairs)
    line = (f"Ordering: {agree} of {len(pairs)} pairs of rows in the paper's order "
            f"(moeify's perplexity against the paper's {recipe.columns.get(recipe.metric, recipe.metric)}).")
    if agree == len(pairs):
        return line + " The orders are the same."
    return (line + f"\n\n- moeify, best first: {' > '.join(row.name for row in ours)}"
                   f"\n- the paper, best first: {' > '.join(row.name for row in theirs)}")


def recipe_table(recipe: Recipe, results: dict[str, dict[str, Any]], model: str) -> str:
    """Markdown: every row of the recipe with moeify's APR, held-out perplexity and its ratio to the dense
    model's beside the paper's figures (a row moeify does not run shows the paper's alone), then the
    ordering line. ``results``: as ``row_results`` gives them."""
    measured = {row.name: results[row.name] for row in recipe.runs if "ppl" in results.get(row.name, {})}
    keys = list(recipe.columns)
    head = ["row", "the paper's label", "method", "options", "APR", "PPL", "x dense PPL",
            *(f"paper: {recipe.columns[k]}" for k in keys)]
    dense_ppl = next((m["dense_ppl"] for m in measured.values()), None)
    lines = [f"## {recipe.title}", "",
             f"The paper: {recipe.model}; {recipe.setting}", f"Here: {model}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| dense | dense | - | - | 1.000 | " + _cell(dense_ppl) + " | 1.00 | "
             + " | ".join(_cell(recipe.dense.get(k)) for k in keys) + " |"]
    for row in recipe.rows:
        ours = measured.get(row.name)
        if row.method is None:
            moeify = ["not in moeify", "-", "-", "-", "-"]
        elif ours is None:
            error = results.get(row.name, {}).get("error", "not run")
            moeify = [row.method, _options(row.options), "-", f"failed: {error}", "-"]
        else:
            moeify = [row.method, _options(ours["options"]), f"{ours['apr']:.3f}",
                      _cell(ours["ppl"]), _cell(ours["ppl"] / ours["dense_ppl"])]
        lines.append("| " + " | ".join([row.name, row.label, *moeify, *(_cell(row.paper.get(k)) for k in keys)])
                     + " |")
    return "\n".join(lines) + "\n\n" + ordering(recipe, measured) + "\n"


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
