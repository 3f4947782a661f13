"""``moeify``: convert dense LLMs into Mixture-of-Experts models and measure them."""

from __future__ import annotations

import argparse
import sys

from moeify.cli import analyze_cmd, bench_cmd, compare_cmd, convert_cmd, eval_cmd, export_cmd, methods_cmd, report_cmd
from moeify.version import __version__

COMMANDS = (convert_cmd, eval_cmd, bench_cmd, compare_cmd, report_cmd, methods_cmd, export_cmd, analyze_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeify",
        description="Turn a dense decoder-only LLM (LLaMA, Mistral, Qwen2/3, Phi, Phi-3, GPT-NeoX) into a "
                    "Mixture-of-Experts model and report perplexity, activated parameters and speed against "
                    "the dense model. Without a MODEL argument the embedded stories260K model is used.",
        epilog="Example: moeify convert --method cmoe --set spec=S1A1E8 --out runs/cmoe")
    parser.add_argument("--version", action="version", version=f"moeify {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"moeify {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
