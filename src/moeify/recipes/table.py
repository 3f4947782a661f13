"""A recipe's rows as moeify measured them, beside the paper's figures, and whether the orderings agree."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import Any

from moeify.evaluation.record import read_record
from moeify.recipes import Recipe


def _measured(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """APR, perplexity and the dense perplexity of a finished row, from its record."""
    if summary is None or "folder" not in summary:
        return None
    record = read_record(Path(summary["folder"]))
    return {"apr": record["active"]["apr"], "ppl": record["metrics"]["ppl"], "dense_ppl": record["metrics"]["dense_ppl"]}


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


def recipe_table(recipe: Recipe, summaries: list[dict[str, Any]], model: str) -> str:
    """Markdown: every row of the recipe with moeify's APR, held-out perplexity and its ratio to the dense
    model's beside the paper's figures (a row moeify does not run shows the paper's alone), then the
    ordering line."""
    by_row = {s.get("row", s["method"]): s for s in summaries}
    measured = {row.name: m for row in recipe.runs if (m := _measured(by_row.get(row.name))) is not None}
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
            error = by_row.get(row.name, {}).get("error", "not run")
            moeify = [row.method, _options(row.options), "-", f"failed: {error}", "-"]
        else:  # the options it ran with: the recipe's and any --set beside them
            moeify = [row.method, _options(by_row[row.name].get("options") or row.options), f"{ours['apr']:.3f}",
                      _cell(ours["ppl"]), _cell(ours["ppl"] / ours["dense_ppl"])]
        lines.append("| " + " | ".join([row.name, row.label, *moeify, *(_cell(row.paper.get(k)) for k in keys)])
                     + " |")
    return "\n".join(lines) + "\n\n" + ordering(recipe, measured) + "\n"


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
