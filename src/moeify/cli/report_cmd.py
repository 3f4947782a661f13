"""``moeify report``: markdown table + PNG plots from run folders' record.json files."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report", help="tables and plots from run folders",
        description="Read the record.json of each RUN_DIR (nothing else) and write report.md with a table "
                    "and PNG plots: perplexity vs activated parameters (Pareto front), per-layer expert "
                    "load, routing JSD per layer, measured speed-ups.")
    parser.add_argument("runs", nargs="+", type=Path, help="folders written by moeify convert")
    parser.add_argument("--out", required=True, type=Path, help="report folder (created atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moeify.report.build import read_runs, settings_note, write_report

    out = write_report(args.runs, args.out, args.overwrite)
    note = settings_note(read_runs(args.runs))
    if note:  # its first line: that the runs differ, and how the plot treats them
        print(note.splitlines()[0].strip("*"))
    print(f"wrote {out}/report.md and its plots")
    return 0
