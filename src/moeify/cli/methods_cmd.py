"""``moeify methods``: the registered methods, their papers and options."""

from __future__ import annotations

import argparse

from moeify.methods import METHODS
from moeify.options import describe


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("methods", help="list the conversion methods with their papers and options",
                            description="List every conversion method with its paper and its --set options.")
    parser.set_defaults(run=run)


def run(_args: argparse.Namespace) -> int:
    for method in METHODS:
        print(f"{method.name}: {method.summary}\n  paper: {method.paper}\n  options (--set KEY=VALUE):")
        for name, kind, default, help_text in describe(method.config_cls):
            print(f"    {name:<20} {kind:<28} default {default!s:<16} {help_text}")
        print()
    return 0
