"""``moeify compare``: every method at a matched activated-parameter ratio, then a report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moeify.cli.common import add_device_arguments


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare", help="run several methods at matched activated parameters and report",
        description="Convert MODEL with each method on the same calibration and evaluation text, matching the "
                    "activated-parameter ratio (APR) where the method allows it (see moeify.api.compare), "
                    "save each run under --out/<method>/ and write --out/report/.")
    parser.add_argument("model", nargs="?", default=None, help="local path or hub name (default: embedded)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated (default: every method, as `moeify methods` lists them)")
    parser.add_argument("--active", "--apr", dest="active", type=float, default=0.5,
                        help="target activated-parameter ratio, APR (default 0.5)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the runs and the report")
    parser.add_argument("--calib", action="append", default=None,
                        help="calibration/training text, as for convert: a file or folder, repeatable (default: "
                             "embedded)")
    parser.add_argument("--eval", default=None, help="evaluation text (default: embedded, disjoint)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=None, help="evaluation window (default: model context)")
    add_device_arguments(parser)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="METHOD.KEY=VALUE: an option of one method, beside (and over) its matched ones (e.g. "
                             "tomoe.steps=250); recover_*=VALUE: a recovery option for every method; repeatable")
    parser.add_argument("--recover-tokens", default="", metavar="N[,N...]",
                        help="recover every conversion by distillation from the dense model for the largest of "
                             "these budgets (training tokens), the perplexity measured after each (the curve of "
                             "report/recovery.png); the same budget for every method")
    parser.add_argument("--jobs", type=int, default=1,
                        help="methods converted at a time, each in its own process with an equal share of the CPU "
                             "threads (default 1)")
    parser.add_argument("--resume", action="store_true", help="continue a comparison in --out: complete runs are "
                                                              "kept, the others run")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --out")
    parser.set_defaults(run=run)


def split_options(pairs: dict[str, Any], methods: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``--set`` values of a comparison: ``METHOD.KEY`` for one method, ``recover_*`` for every method's
    recovery; returns (per-method options, recovery options)."""
    per_method: dict[str, dict[str, Any]] = {method: {} for method in methods}
    shared: dict[str, Any] = {}
    for key, value in pairs.items():
        method, dot, name = key.partition(".")
        if dot:
            if method not in per_method:
                raise ValueError(f"--set {key}: {method!r} is not one of the compared methods ({', '.join(methods)})")
            per_method[method][name] = value
        elif key.startswith("recover_"):
            shared[key] = value
        else:
            raise ValueError(f"--set {key}: name the method (METHOD.{key}) or give a recovery option (recover_*)")
    return per_method, shared


def run(args: argparse.Namespace) -> int:
    from moeify.cli.recover_cmd import parse_milestones
    from moeify.files import check_not_an_input, output_lock
    from moeify.methods import METHODS, get_method
    from moeify.options import build_config, parse_assignments
    from moeify.training.recovery_options import RecoveryOptions

    names = args.methods or ",".join(m.name for m in METHODS)
    methods = [m.strip() for m in names.split(",") if m.strip()]
    for name in methods:
        get_method(name)  # unknown names fail before any work
    if not 0 < args.active <= 1:
        raise ValueError(f"--active={args.active} is out of range; allowed: (0, 1]")
    if args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs} is out of range; allowed: >= 1")
    check_not_an_input(args.out, [args.model, *(args.calib or []), args.eval])
    per_method, recovery = split_options(parse_assignments(args.set), methods)
    budgets = parse_milestones(args.recover_tokens)
    if recovery and not budgets:
        raise ValueError("recover_* options need a budget: --recover-tokens N")
    build_config(RecoveryOptions, {**recovery, "recover_tokens": max(budgets, default=0)})  # fail before any work
    from moeify.api import run_comparison

    with output_lock(args.out):
        summaries = run_comparison(args.model, methods, args.active, args.out, calib=args.calib, eval=args.eval,
                                   seed=args.seed, device=args.device, dtype=args.dtype,
                                   progress=True, overwrite=args.overwrite, resume=args.resume, options=per_method,
                                   recovery=recovery, recover_tokens=budgets, eval_seq_len=args.seq_len,
                                   jobs=args.jobs)
        (args.out / "compare.json").write_text(json.dumps(summaries, indent=2) + "\n")
    for s in summaries:
        print(f"{s['method']:<14} {s['matched']:<45} {s.get('folder') or 'FAILED: ' + s['error']}")
    report = args.out / "report" / "report.md"
    if report.is_file():
        print(report.read_text().split("\n\n", 1)[1].split("\n!", 1)[0])
    print(f"wrote {report}")
    return 0
