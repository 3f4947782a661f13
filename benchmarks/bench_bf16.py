"""Every method converting SmolLM2-135M in bfloat16 against the same conversion in float32.

Both convert the same weights: SmolLM2 as the bfloat16 checkpoint its publishers ship, made once from the
GGUF file (dequantised, rounded to bfloat16, saved into ``--checkpoint``). The GGUF's dequantised float32
weights themselves are not bfloat16 numbers, and rounding them is a change of model: a comparison with
them would measure that change, not the working dtype. For each method (its defaults, training methods at
a short CPU budget), one process converts the checkpoint with ``--dtype float32`` and another with
``--dtype bfloat16``, each calibrated/trained on WikiText-2 valid; both saved models are then scored, each
in its dtype, on a prefix of WikiText-2 raw test (``--eval-chars``, 512-token windows). Prints one JSON
line per method with both perplexities, their relative gap and its standard error, appended to ``--out``;
the bound asked for is 1 %.

The standard error (``evaluation.perplexity.relative_change``: paired, over windows) is what the choice of
text adds to the gap. It matters for methods whose hard decisions make the model chaotic: in float32,
TEAL's perplexity moves by 1-2 % when its projections' inputs move by 16 float32 ulps
(``bench_precision_floor.py``): any perturbation re-draws its tokens' losses, so that over a few thousand
tokens a percent or so is sampling error, and only a longer text resolves a 1 % bound.

    python benchmarks/bench_bf16.py [--methods cmoe,more,...] [--eval-chars 20000]
        [--checkpoint /tmp/smollm2-135m-bf16] [--out benchmarks/results/bench_bf16.jsonl] [--work DIR]
    python benchmarks/bench_bf16.py --markdown before|current|dsmoe_margin   # a table of docs/scaling.md

ToMoE's training takes over an hour on a CPU: with ``--work DIR`` the run can be stopped (its checkpoints every 25
steps are kept in ``DIR/tomoe/DTYPE.work``) and the same command continues it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_bf16.jsonl"

# Training methods at a CPU budget (their defaults: hundreds of steps). ToMoE at 250 of its 600 default steps
# (a 10-step ToMoE is untrained and chaotic; 600 steps in both dtypes take about 3 h at 7-10 s a step here),
# without activation checkpointing (memory is not short here: 4.3 GiB peak), checkpointed often enough to
# stop and resume (--work). DSMoE at 30 steps: its gates start at logit 1 and take about that long to cross tau.
OPTIONS = {"tomoe": {"steps": 250, "recompute": False, "checkpoint_every": 25},
           "dsmoe": {"steps": 30, "checkpoint_every": 0},
           "dense2moe": {"steps": 10, "checkpoint_every": 0, "seq_len": 256}}
METHODS = "cmoe,more,static_prune,random_split,teal,tomoe,dsmoe,dense2moe"


def bf16_checkpoint(folder: Path) -> Path:
    """SmolLM2's GGUF weights rounded to bfloat16 and saved with the tokenizer into ``folder`` (once)."""
    from bench_real import MODEL  # this folder is on sys.path when run

    from moeify.loading import load_model

    if not (folder / "config.json").is_file():
        model, tokenizer = load_model(MODEL, dtype="bfloat16")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def eval_prefix(folder: Path, chars: int) -> Path:
    """The first ``chars`` characters of WikiText-2 raw test, as a file in ``folder``."""
    from bench_real import EVAL

    path = folder / f"wikitext2_raw_test_first{chars}.txt"
    path.write_text(EVAL.read_text()[:chars])
    return path


def report(row: dict, out: Path) -> None:
    """Print ``row`` as a JSON line and append it to ``out``."""
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def arguments(doc: str, methods: str, results: str) -> argparse.ArgumentParser:
    """The options this benchmark and ``bench_precision_floor.py`` share."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--methods", default=methods)
    parser.add_argument("--eval-chars", type=int, default=20_000)
    parser.add_argument("--checkpoint", type=Path, default=Path(tempfile.gettempdir()) / "smollm2-135m-bf16")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / results)
    return parser


def convert(method: str, model: Path, dtype: str, eval_file: Path, out: Path) -> None:
    """``method``'s conversion of ``model`` in ``dtype``, saved into ``out`` by a fresh process (whose own
    metrics, on ``eval_file``, are shown as progress, not reported). Nothing to do where ``out`` holds it already; a
    training conversion stopped before it finished (``out``'s work folder holds a checkpoint) goes on from
    its latest checkpoint."""
    from bench_real import CALIB

    from moeify.cli.convert_cmd import work_dir
    from moeify.training.checkpoint import last_checkpoint

    if (out / "config.json").is_file():
        return
    sets = [arg for key, value in OPTIONS.get(method, {}).items() for arg in ("--set", f"{key}={value}")]
    if last_checkpoint(work_dir(out)) is not None:
        sets += ["--set", "resume=true"]
    command = [sys.executable, "-m", "moeify", "convert", str(model), "--method", method, "--dtype", dtype,
               *sets, "--calib", str(CALIB), "--eval", str(eval_file), "--seq-len", "512", "--no-speed",
               "--out", str(out)]
    # its progress bars and report on this process's stderr: the JSON lines on stdout stay the results only
    child = subprocess.run(command, stdout=sys.stderr, check=False)
    if child.returncode:
        raise SystemExit(f"bench_bf16: {method} in {dtype} failed (exit {child.returncode}); its error is above")


# The tables of docs/scaling.md, by line of the results file (1-based, the file is only appended to): the code
# of the time (before float32 masters and the DSMoE margin start), every method again with a later version, and
# DSMoE with its margin start. The rows trained under bfloat16 autocast (float32 master weights, bfloat16
# arithmetic: the code before fully trained models computed in float32) are marked as such.
DOC_TABLES = {"before": (9, 21, 3, 22, 4, 23, 11, 19, 10, 20, 18, 26, 27, 14, 13, 17, 24, 15, 16, 25),
              "current": (28, 29, 30, 31, 37, 32, 35, 33, 36, 34),
              "dsmoe_margin": (39,)}
AUTOCAST_LINES = frozenset({13, 14, 15, 26})


def gap_cell(row: dict) -> str:
    """The relative gap in %, with its standard error where the row has one; bold under the 1 % bound."""
    gap = f"{100 * row['relative_gap']:.2f} %"
    if row.get("stderr") is not None:
        gap += f" +- {100 * row['stderr']:.2f} %"
    return f"**{gap}**" if row["relative_gap"] < 0.01 else gap


def markdown(path: Path, table: str) -> str:
    """``DOC_TABLES[table]``: the lines of ``path`` it names, one row each."""
    rows = path.read_text().splitlines()
    lines = ["| method | options | float32 | bfloat16 | gap |", "|---|---|---|---|---|"]
    for number in DOC_TABLES[table]:
        row = json.loads(rows[number - 1])
        options = [f"{key}={value}" for key, value in row["options"].items()] or ["defaults"]
        if row["eval"] != "wikitext2_raw_test_first20000.txt":
            options.append(f"{int(row['eval'].removeprefix('wikitext2_raw_test_first').removesuffix('.txt')):,} "
                           "characters")
        note = " (bfloat16 autocast)" if number in AUTOCAST_LINES else ""
        lines.append(f"| {row['method']} | {', '.join(options)} | {row['ppl']['float32']:.2f} | "
                     f"{row['ppl']['bfloat16']:.2f} | {gap_cell(row)}{note} |")
    return "\n".join(lines)


def main() -> None:
    parser = arguments(__doc__, METHODS, "bench_bf16.jsonl")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the conversions in WORK/METHOD/DTYPE (default: a temporary folder): a later run "
                             "scores them without converting again, and continues one stopped while training")
    parser.add_argument("--markdown", choices=sorted(DOC_TABLES),
                        help="print that table of docs/scaling.md from --out (DOC_TABLES: lines of the file) and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out, args.markdown))
        return
    from moeify.calibration.data import read_text
    from moeify.evaluation.perplexity import perplexity, relative_change
    from moeify.loading import load_model

    model = bf16_checkpoint(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        eval_file = eval_prefix(Path(tmp), args.eval_chars)
        smoke_file = eval_prefix(Path(tmp), min(args.eval_chars, 4000))  # the conversions' own metrics
        eval_source = read_text(eval_file)
        work = Path(tmp) if args.work is None else args.work
        for method in args.methods.split(","):
            scored = {}
            for dtype in ("float32", "bfloat16"):
                folder = work / method / dtype
                convert(method, model, dtype, smoke_file, folder)
                converted, tokenizer = load_model(folder)
                scored[dtype] = perplexity(converted, tokenizer, eval_source, 512)
            change, stderr = relative_change(scored["float32"], scored["bfloat16"])
            row = {"method": method, "options": OPTIONS.get(method, {}), "model": "SmolLM2-135M bfloat16 checkpoint",
                   "eval": eval_file.name, "eval_tokens": scored["float32"].tokens,
                   "ppl": {dtype: result.ppl for dtype, result in scored.items()},
                   "relative_gap": round(abs(change), 4), "relative_change": round(change, 5),
                   "stderr": None if stderr is None else round(stderr, 5)}
            report(row, args.out)


if __name__ == "__main__":
    main()
