"""One headline table of each paper run as its recipe on SmolLM2-135M-Instruct (the GGUF in ../shared/assets),
the rows kept in ``benchmarks/results/bench_recipes.jsonl``; each method's page shows its paper's table.

A recipe holds the paper's setting, budgets included (ToMoE's 10,000 steps, DSMoE's 10B tokens, Dense2MoE's
4,500 steps); ``BUDGETS`` lowers them to what this CPU trains in minutes, through ``moeify compare``'s
``--set``, and says so in every row. Calibration (and training) text: WikiText-2 valid; evaluation text:
bench_real's (the first 100,000 characters of WikiText-2 raw test, 2048-token windows).

    python benchmarks/bench_recipes.py [--recipes cmoe_table1,more_table10,...] [--resume]  # convert and record
    python benchmarks/bench_recipes.py --markdown RECIPE                          # RECIPE's table from the file
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_real import CALIB, MODEL, write_eval_prefix  # this folder is on sys.path when run
from results_file import append_row, read_rows

from moeify.recipes import load_recipe
from moeify.recipes.table import recipe_table, row_results

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_recipes.jsonl"
MODELS = HERE / "results" / "models" / "recipes"
EVAL_CHARS = 100_000
# one recipe per paper, each with the budget this CPU affords (the recipes' own budgets are the papers')
BUDGETS: dict[str, dict[str, str]] = {
    # the fine-tuned rows only (a method-wide value would fine-tune the training-free rows too)
    "cmoe_table1": {f"{row}_ft.{key}": value for row in ("cmoe_s1a1e8", "cmoe_s1a3e16", "cmoe_s2a2e16")
                    for key, value in (("finetune_samples", "32"), ("finetune_seq_len", "512"))},
    "more_table10": {},
    "tomoe_table1": {"tomoe.steps": "40", "tomoe.checkpoint_every": "0"},
    "dsmoe_table3": {"dsmoe.steps": "20", "dsmoe.batch_size": "8", "dsmoe.seq_len": "256",
                     "dsmoe.checkpoint_every": "0", "dsmoe.analyses": "false"},
    "dense2moe_table5": {"dense2moe.steps": "30", "dense2moe.warmup": "3", "dense2moe.seq_len": "256",
                         "dense2moe.checkpoint_every": "0"},
}


def command(name: str, out: Path, eval_file: Path, resume: bool) -> list[str]:
    sets = [arg for key, value in BUDGETS[name].items() for arg in ("--set", f"{key}={value}")]
    return [sys.executable, "-m", "moeify", "compare", str(MODEL), "--recipe", name, "--out", str(out),
            "--calib", str(CALIB), "--eval", str(eval_file), "--seq-len", "2048",
            "--resume" if resume else "--overwrite", *sets]


def run(name: str, resume: bool) -> None:
    """Convert every row of recipe ``name`` (``resume``: but the rows an earlier run of it completed) and
    append them to the results file, replacing its earlier rows."""
    MODELS.mkdir(parents=True, exist_ok=True)
    out = MODELS / name
    argv = command(name, out, write_eval_prefix(EVAL_CHARS, MODELS), resume)
    subprocess.run(argv, check=True)
    results = row_results(json.loads((out / "compare.json").read_text()))
    kept = [row for row in read_rows(RESULTS) if row["recipe"] != name] if RESULTS.is_file() else []
    RESULTS.write_text("".join(json.dumps(row) + "\n" for row in kept))
    for row, result in results.items():
        append_row(RESULTS, {"recipe": name, "row": row, **result, "budget": BUDGETS[name],
                             "command": " ".join(["moeify", *argv[3:]])})


def markdown(name: str) -> str:
    """Recipe ``name``'s table, as ``moeify compare --recipe`` prints it, from the results file."""
    rows = [row for row in read_rows(RESULTS) if row["recipe"] == name]
    if not rows:
        raise SystemExit(f"{RESULTS.name} has no rows of {name}: run python benchmarks/bench_recipes.py --recipes {name}")
    budget = ", ".join(f"{key}={value}" for key, value in rows[0]["budget"].items()) or "the recipe's own"
    table = recipe_table(load_recipe(name), {row["row"]: row for row in rows}, f"{MODEL.name}, budget {budget}")
    return table.split("\n", 2)[2]  # the page has its own heading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(BUDGETS), help=f"comma-separated, of: {', '.join(BUDGETS)}")
    parser.add_argument("--resume", action="store_true", help="keep the rows an interrupted run completed")
    parser.add_argument("--markdown", metavar="RECIPE", help="print RECIPE's table from the results file")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.markdown), end="")
        return
    names = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = [name for name in names if name not in BUDGETS]
    if unknown:
        raise SystemExit(f"--recipes: {', '.join(unknown)} not one of {', '.join(BUDGETS)}")
    for name in names:
        run(name, args.resume)
        print(markdown(name))


if __name__ == "__main__":
    main()
