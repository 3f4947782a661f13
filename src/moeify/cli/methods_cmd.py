"""``moeify methods``: the registered methods, their papers and options (``--markdown``: docs/methods.md's
option tables, generated from the config classes so that the docs cannot drift from the code)."""

from __future__ import annotations

import argparse
from typing import Any

from moeify.options import describe


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("methods", help="list the conversion methods with their papers and options",
                            description="List every conversion method with its paper and its --set options.")
    parser.add_argument("--markdown", action="store_true",
                        help="print a markdown section per method with a table of its options (docs/methods.md's)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(markdown() if args.markdown else listing(), end="")
    return 0


def listing() -> str:
    """The plain listing: per method its summary, paper and options with type, default and help."""
    from moeify.methods import METHODS
    from moeify.training.recovery_options import RecoveryOptions

    lines = []
    for method in METHODS:
        lines += [f"{method.name}: {method.summary}", f"  paper: {method.paper}", "  options (--set KEY=VALUE):"]
        lines += [f"    {name:<20} {kind:<28} default {default!s:<16} {help_text}"
                  for name, kind, default, help_text in describe(method.config_cls)]
        lines.append("")
    lines += ["recovery (every method, convert --set or moeify recover --set): distillation from the dense model",
              "  options (--set KEY=VALUE):"]
    lines += [f"    {name:<26} {kind:<22} default {default!s:<16} {help_text}"
              for name, kind, default, help_text in describe(RecoveryOptions)]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Table-cell text: a ``|`` would end the cell (inside code spans too), so it is escaped."""
    return text.replace("|", "\\|")


def _value(default: Any) -> str:
    """A default as it is written after ``--set KEY=``."""
    if default is None:
        return "none"
    return str(default).lower() if isinstance(default, bool) else str(default)


def _option_table(config_cls: type) -> list[str]:
    """A markdown table of a config's ``--set`` options."""
    return ["| option | type | default | meaning |", "|---|---|---|---|"] + [
        f"| `{name}` | `{_cell(kind)}` | `{_cell(_value(default))}` | {_cell(help_text)} |"
        for name, kind, default, help_text in describe(config_cls)]


def markdown() -> str:
    """Per method a ``### `name``` section: paper, summary and a table of its ``--set`` options; then the
    recovery's options, which every method takes."""
    from moeify.methods import METHODS
    from moeify.training.recovery_options import RecoveryOptions

    lines = []
    for method in METHODS:
        summary = method.summary[:1].upper() + method.summary[1:]
        lines += [f"### `{method.name}`", "", f"Paper: {method.paper}.", "", f"{summary}.", "",
                  *_option_table(method.config_cls), ""]
    lines += ["### Recovery (every method)", "",
              ("A distillation from the dense model after the conversion: `convert --set recover_tokens=N` or "
               "`moeify recover RUN --tokens N`."), "", *_option_table(RecoveryOptions), ""]
    return "\n".join(lines)
