"""``moeify methods``: the registered methods, their papers and options (``--markdown``: the option tables of
the documentation's method pages, generated from the config classes so that the docs cannot drift from the
code)."""

from __future__ import annotations

import argparse
from typing import Any

from moeify.options import describe

RECOVERY, ATTENTION = "recovery", "attention"  # the sections of the options every method takes, named like methods


# each section every method takes: (its listing's first line, its markdown heading, what it is)
COMMON = {
    RECOVERY: ("recovery (every method, convert --set or moeify recover --set): distillation from the dense model",
               "Recovery (every method)",
               "Training after the conversion for a budget of tokens, by distillation from the dense model, the LM "
               "loss, or both (`recover_lm_share`; half of each by default): `convert --set recover_tokens=N` or "
               "`moeify recover RUN --tokens N`."),
    ATTENTION: ("attention (methods that keep the attention whole, convert --set): TEAL's thresholds on it",
                "Attention thresholds (methods that keep the attention whole)",
                "TEAL's magnitude thresholds on the attention projections' inputs after the conversion, calibrated "
                "again after a recovery: `convert --set attention_sparsity=S`; `moeify compare` with "
                "`--set METHOD.attention_sparsity=S` matches the method's own budget to what they leave."),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("methods", help="list the conversion methods with their papers and options",
                            description="List every conversion method with its paper and its --set options, then "
                                        "the options that every method takes: the recovery's and the attention "
                                        f"thresholds'; with METHOD, only that one ('{RECOVERY}', '{ATTENTION}').")
    parser.add_argument("name", nargs="?", default=None, metavar="METHOD",
                        help=f"only this method, or '{RECOVERY}' or '{ATTENTION}' (default: every method, then "
                             "those two)")
    parser.add_argument("--markdown", action="store_true",
                        help="print a markdown section per method with a table of its options (the block of "
                             "docs/methods/<method>.md; the recovery's and the attention's: of "
                             "docs/methods/index.md)")
    parser.set_defaults(run=run)


def section_names() -> list[str]:
    """The sections both outputs are made of, in order: every method, then the recovery and the attention
    thresholds."""
    from moeify.methods import METHODS

    return [*(method.name for method in METHODS), *COMMON]


def _check_name(name: str | None) -> None:
    if name is not None and name not in section_names():
        raise ValueError(f"unknown method {name!r}; available: {', '.join(section_names())}")


def run(args: argparse.Namespace) -> int:
    _check_name(args.name)
    print(markdown(args.name) if args.markdown else listing(args.name), end="")
    return 0


def _common_options(name: str) -> type:
    """The config class of one of the sections every method takes."""
    from moeify.methods import AttentionSparsityOptions  # the registry's: no torch import
    from moeify.training.recovery_options import RecoveryOptions

    return {RECOVERY: RecoveryOptions, ATTENTION: AttentionSparsityOptions}[name]


def _listing_section(name: str) -> list[str]:
    from moeify.methods import get_method

    if name in COMMON:
        return [COMMON[name][0], "  options (--set KEY=VALUE):",
                *(f"    {option:<26} {kind:<22} default {default!s:<16} {help_text}"
                  for option, kind, default, help_text in describe(_common_options(name))), ""]
    method = get_method(name)
    return [f"{method.name}: {method.summary}", f"  paper: {method.paper}", "  options (--set KEY=VALUE):",
            *(f"    {option:<20} {kind:<28} default {default!s:<16} {help_text}"
              for option, kind, default, help_text in describe(method.config_cls)), ""]


def listing(name: str | None = None) -> str:
    """The plain listing: per method its summary, paper and options with type, default and help; then the
    options every method takes. ``name``: that section only."""
    _check_name(name)
    lines = [line for section in ([name] if name else section_names()) for line in _listing_section(section)]
    return "\n".join(lines).rstrip("\n") + "\n"


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


def _markdown_section(name: str) -> str:
    """One section, ending in a newline: a method's ``### `name``` heading, paper, summary and options table,
    or a section every method takes: its heading, what it is and its table."""
    from moeify.methods import get_method

    if name in COMMON:
        _, heading, text = COMMON[name]
        lines = [f"### {heading}", "", text, "", *_option_table(_common_options(name))]
    else:
        method = get_method(name)
        summary = method.summary[:1].upper() + method.summary[1:]
        lines = [f"### `{method.name}`", "", f"Paper: {method.paper}.", "", f"{summary}.", "",
                 *_option_table(method.config_cls)]
    return "\n".join(lines) + "\n"


def markdown(name: str | None = None) -> str:
    """Per method a ``### `name``` section: paper, summary and a table of its ``--set`` options; then the
    options every method takes (the recovery's, the attention thresholds'). ``name``: that section only, as its
    page holds it; the whole output is the sections joined by a blank line."""
    _check_name(name)
    return "\n".join(_markdown_section(section) for section in ([name] if name else section_names()))
