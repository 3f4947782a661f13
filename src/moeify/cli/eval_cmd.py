"""``moeify eval``: perplexity per data file and the activated ratios measured on it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeify.cli.format import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval", help="evaluate a dense or converted model",
        description="Perplexity of MODEL_OR_DIR on each --data file (default: the embedded evaluation "
                    "slice), with the activated-parameter ratios measured on that data. --set changes "
                    "runtime options of a converted model (e.g. top_k) without converting again.")
    parser.add_argument("model", help="converted folder, dense folder or hub name ('embedded:stories260K')")
    parser.add_argument("--data", action="append", default=[], help="text/jsonl file, repeatable")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: model context)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="runtime option")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import moeify
    from moeify.methods.options import parse_assignments

    options = parse_assignments(args.set)
    model, tokenizer = moeify.load_model(args.model, args.device)
    results = moeify.evaluate(model, tokenizer, args.data or None, seq_len=args.seq_len, runtime_options=options)
    rows = [(f"perplexity {name}", f"{ppl:.3f}") for name, ppl in results["ppl"].items()]
    rows += [("activated MLP ratio", f"{results['active']['mlp_ratio']:.3f}"),
             ("activated param ratio (APR)", f"{results['active']['apr']:.3f}")]
    print_table(f"moeify eval {args.model}", rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
