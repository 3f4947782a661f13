"""``moeify eval``: perplexity per data file, zero-shot task accuracy (lm-eval), and the activated ratios
measured on that data."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeify.cli.common import add_device_arguments, add_layer_by_layer_argument
from moeify.cli.format import print_table
from moeify.evaluation.harness import TASKS, check_tasks


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval", help="evaluate a dense or converted model",
        description="Perplexity of MODEL_OR_DIR on each --data file (default: the embedded evaluation "
                    "slice), with the activated-parameter ratios measured on that data. --set changes "
                    "runtime options of a converted model (e.g. top_k) without converting again.")
    parser.add_argument("model", help="converted folder, dense folder or hub name ('embedded:stories260K')")
    parser.add_argument("--data", action="append", default=[], help="text/jsonl file, repeatable")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: model context)")
    parser.add_argument("--protocol", choices=("windows", "bos-per-doc", "sliding"), default="windows",
                        help="perplexity protocol (default windows: text as-is, BOS at start only, non-overlapping "
                             "windows, first token of each unscored); see moeify.evaluation.perplexity")
    parser.add_argument("--stride", type=int, default=None, help="window step of --protocol sliding")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="runtime option")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results to this JSON file (an existing one only with --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    add_device_arguments(parser)
    add_layer_by_layer_argument(parser)
    harness = parser.add_argument_group(
        "zero-shot tasks (lm-evaluation-harness, offline; pip install -e \".[eval]\")",
        "Without --data, only the tasks run (no perplexity).")
    harness.add_argument("--tasks", type=lambda s: [t for t in s.split(",") if t], default=None,
                         metavar="T1,T2", help="comma-separated: " + ", ".join(TASKS))
    harness.add_argument("--task-data", type=Path, default=None, metavar="DIR",
                         help="folder laid out like ../shared/assets/data (arc/, piqa/, ...)")
    harness.add_argument("--limit", type=int, default=None, help="first N items of each task (default: all)")
    harness.add_argument("--batch-size", type=int, default=16, help="lm-eval batch size")
    parser.set_defaults(run=run)


def _task_rows(tasks: dict[str, dict[str, float]]) -> list[tuple[str, str]]:
    """One row per task and metric, with lm-eval's standard error: at small --limit it is large."""
    rows = []
    for task, scores in tasks.items():
        for metric in ("acc", "acc_norm"):
            if metric in scores:
                stderr = scores.get(f"{metric}_stderr")
                value = f"{scores[metric]:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")
                rows.append((f"{task} {metric} (n={scores['n']})", value))
    return rows


MIN_SCORED_TOKENS = 1000  # below this a perplexity is mostly noise: warn


def run(args: argparse.Namespace) -> int:
    import moeify
    from moeify.calibration.data import read_text
    from moeify.files import check_output_file, write_output_file
    from moeify.options import parse_assignments

    options = parse_assignments(args.set)
    if args.json:
        check_output_file(args.json, args.overwrite, [args.model, *args.data, args.task_data])
    if args.tasks and args.layer_by_layer:
        print("moeify eval: error: --tasks needs the whole model in memory; leave out --layer-by-layer "
              "(perplexity runs layer by layer)", file=sys.stderr)
        return 2
    if args.tasks:
        try:  # before loading the model: a missing lm-eval or data file fails at once
            check_tasks(args.tasks, args.task_data, args.limit)
        except ImportError as error:
            print(f"moeify eval: error: {error}", file=sys.stderr)
            return 2
    for data in args.data:  # a missing, empty or binary data file fails before the model loads
        read_text(data)
    model, tokenizer = moeify.load_model(args.model, args.device, args.dtype, layer_by_layer=args.layer_by_layer)
    results = moeify.evaluate(model, tokenizer, args.data or None, seq_len=args.seq_len, runtime_options=options,
                              protocol=args.protocol, stride=args.stride,
                              tasks=args.tasks, task_data=args.task_data, limit=args.limit,
                              batch_size=args.batch_size)
    for name, result in results["eval"].items():
        if result["tokens"] < MIN_SCORED_TOKENS:
            print(f"warning: the perplexity of {name} rests on {result['tokens']} scored token(s); below "
                  f"{MIN_SCORED_TOKENS} it says little (pass more text)", file=sys.stderr)
    rows = [(f"perplexity {name}", f"{ppl:.3f}") for name, ppl in results["ppl"].items()]
    rows += _task_rows(results.get("tasks", {}))
    rows += [("activated MLP ratio", f"{results['active']['mlp_ratio']:.3f}"),
             ("activated param ratio (APR)", f"{results['active']['apr']:.3f}")]
    print_table(f"moeify eval {args.model}", rows)
    if args.json:
        write_output_file(args.json, json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
