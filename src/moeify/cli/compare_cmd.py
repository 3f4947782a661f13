"""``moeify compare``: every method at a matched activated-parameter ratio, then a report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeify.cli.common import add_device_arguments

if TYPE_CHECKING:
    from moeify.recipes import Recipe


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare", help="run several methods at matched activated parameters and report",
        description="Convert MODEL with each method on the same calibration and evaluation text, matching the "
                    "activated-parameter ratio (APR) where the method allows it (see moeify.api.compare), "
                    "save each run under --out/<method>/ and write --out/report/.")
    parser.add_argument("model", nargs="?", default=None, help="local path or hub name (default: embedded)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated (default: every method, as `moeify methods` lists them)")
    parser.add_argument("--active", "--apr", dest="active", type=float, default=None,
                        help="target activated-parameter ratio, APR (default 0.5)")
    parser.add_argument("--recipe", default=None, metavar="NAME|FILE",
                        help="a paper's table instead of --methods/--apr: convert each of its rows with the row's "
                             "options and print them beside the paper's figures (--out/recipe.md); shipped: "
                             f"{', '.join(_recipe_names())}")
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
                             "tomoe.steps=250; with --recipe: of every row of that method, or ROW.KEY=VALUE of one "
                             "row); recover_*=VALUE: a recovery option for every method; repeatable")
    parser.add_argument("--recover-tokens", default="", metavar="N[,N...]",
                        help="recover every conversion by distillation from the dense model for the largest of "
                             "these budgets (training tokens), the perplexity measured after each (the curve of "
                             "report/recovery.png); the same budget for every method")
    parser.add_argument("--jobs", type=int, default=1,
                        help="methods converted at a time, each in its own process with an equal share of the CPU "
                             "threads (default 1)")
    parser.add_argument("--resume", action="store_true", help="continue a comparison in --out: complete runs of "
                                                              "the options asked now are kept, the others run")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --out")
    parser.set_defaults(run=run)


def _recipe_names() -> list[str]:
    from moeify.recipes import recipe_names

    return recipe_names()


def recipe_targets(recipe: Recipe) -> dict[str, list[str]]:
    """What each ``--set`` prefix of a recipe's comparison sets: a method, all its rows; a row, itself. A row
    named as its method (DSMoE's ``dsmoe``) is no target of its own: the name sets every row of the method."""
    methods = {row.method for row in recipe.runs}
    return {**{row.name: [row.name] for row in recipe.runs},
            **{m: [row.name for row in recipe.runs if row.method == m] for m in sorted(methods)}}


def split_options(pairs: dict[str, Any], targets: dict[str, list[str]]) -> tuple[dict[str, dict[str, Any]],
                                                                                  dict[str, Any]]:
    """``--set`` values of a comparison: ``TARGET.KEY`` for the runs ``targets`` names by that prefix (a
    method: its runs; a recipe's row: itself), ``recover_*`` for every run's recovery; returns (per-run
    options, recovery options). A row's own value is taken over its method's."""
    per_run: dict[str, dict[str, Any]] = {run: {} for runs in targets.values() for run in runs}
    shared: dict[str, Any] = {}

    def one_row(key: str) -> bool:
        target = key.partition(".")[0]
        return targets.get(target) == [target]

    # a method's values first, then a row's, which win
    for key, value in sorted(pairs.items(), key=lambda item: one_row(item[0])):
        target, dot, name = key.partition(".")
        if dot:
            if target not in targets:
                raise ValueError(f"--set {key}: {target!r} is not one of the compared methods or rows "
                                 f"({', '.join(targets)})")
            for run in targets[target]:
                per_run[run][name] = value
        elif key.startswith("recover_"):
            shared[key] = value
        else:
            raise ValueError(f"--set {key}: name the method (METHOD.{key}) or give a recovery option (recover_*)")
    return per_run, shared


def run(args: argparse.Namespace) -> int:
    from moeify.cli.recover_cmd import parse_milestones
    from moeify.files import check_not_an_input, output_lock
    from moeify.methods import METHODS, get_method
    from moeify.options import build_config, parse_assignments
    from moeify.training.recovery_options import RecoveryOptions

    recipe = None
    if args.recipe is not None:
        from moeify.recipes import load_recipe

        if args.methods is not None or args.active is not None:
            raise ValueError("--recipe names its rows' methods and options: leave out --methods and --apr")
        recipe = load_recipe(args.recipe)  # validated whole, every row's options included
        methods = sorted({row.method for row in recipe.runs})
        targets = recipe_targets(recipe)
    else:
        names = args.methods or ",".join(m.name for m in METHODS)
        methods = [m.strip() for m in names.split(",") if m.strip()]
        for name in methods:
            get_method(name)  # unknown names fail before any work
        targets = {method: [method] for method in methods}
    active = 0.5 if args.active is None else args.active
    if not 0 < active <= 1:
        raise ValueError(f"--active={active} is out of range; allowed: (0, 1]")
    if args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs} is out of range; allowed: >= 1")
    check_not_an_input(args.out, [args.model, *(args.calib or []), args.eval])
    per_run, recovery = split_options(parse_assignments(args.set), targets)
    budgets = parse_milestones(args.recover_tokens)
    if recovery and not budgets:
        raise ValueError("recover_* options need a budget: --recover-tokens N")
    build_config(RecoveryOptions, {**recovery, "recover_tokens": max(budgets, default=0)})  # fail before any work
    from moeify.api import run_comparison
    from moeify.api.compare import RECIPE_TABLE

    with output_lock(args.out):
        summaries = run_comparison(args.model, methods, active, args.out, calib=args.calib, eval=args.eval,
                                   seed=args.seed, device=args.device, dtype=args.dtype,
                                   progress=True, overwrite=args.overwrite, resume=args.resume, options=per_run,
                                   recovery=recovery, recover_tokens=budgets, eval_seq_len=args.seq_len,
                                   jobs=args.jobs, recipe=recipe)
        (args.out / "compare.json").write_text(json.dumps(summaries, indent=2) + "\n")
    for s in summaries:
        print(f"{s['row']:<14} {s['matched']:<45} {s.get('folder') or 'FAILED: ' + s['error']}")
    report = args.out / "report" / "report.md"
    if report.is_file():
        print(report.read_text().split("\n\n", 1)[1].split("\n!", 1)[0])
    print(f"wrote {report}")
    if recipe is not None:
        print((args.out / RECIPE_TABLE).read_text())
        print(f"wrote {args.out / RECIPE_TABLE}")
    return 0
