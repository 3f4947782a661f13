"""``moeify``: convert dense LLMs into Mixture-of-Experts models and measure them."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from moeify.cli import (
    analyze_cmd,
    bench_cmd,
    compare_cmd,
    convert_cmd,
    eval_cmd,
    export_cmd,
    methods_cmd,
    plan_cmd,
    recover_cmd,
    report_cmd,
)
from moeify.interrupt import interruptible
from moeify.version import __version__

# the model families of ``arch.families.FAMILIES`` as users name them (a test keeps the two together); written
# out so that ``--help`` needs no import of torch
FAMILY_NAMES = "LLaMA/Llama-3, Mistral, Qwen2, Qwen3, Gemma-3, Gemma-2, OLMo-2, Granite, Phi-3, GPT-NeoX, Phi"
COMMANDS = (convert_cmd, recover_cmd, eval_cmd, bench_cmd, compare_cmd, report_cmd, methods_cmd, export_cmd,
            analyze_cmd, plan_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeify",
        description=f"Turn a dense decoder-only LLM ({FAMILY_NAMES}) into a Mixture-of-Experts model and report "
                    "perplexity, activated parameters and speed against the dense model. MODEL is a local folder, a "
                    "hub name or a llama.cpp .gguf file; without it the embedded stories260K model is used.",
        epilog="Example: moeify convert --method cmoe --set spec=S1A1E8 --out runs/cmoe")
    parser.add_argument("--version", action="version", version=f"moeify {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _resume_hint(args: argparse.Namespace, argv: list[str]) -> str:
    """Where the last training checkpoint is and the command that continues from it: ``resume=true`` for a
    method's own training, ``recover_resume=true`` for a recovery's."""
    from moeify.cli.convert_cmd import work_dir
    from moeify.options import parse_assignments, parse_bool
    from moeify.training.checkpoint import last_checkpoint
    from moeify.training.recovery import CHECKPOINTS

    out = getattr(args, "out", None)
    if args.command == "compare":  # its methods' checkpoints live in their own work folders
        again = argv if "--resume" in argv else [*argv, "--resume"]
        return ("; the methods it finished are kept, and each one's training continues from its last checkpoint "
                f"with: {' '.join(shlex.quote(a) for a in ['moeify', *again])}")
    work = None if out is None else work_dir(Path(out))
    recovery = None if work is None else last_checkpoint(work, only=CHECKPOINTS)  # the stage that ran last
    last = recovery or (None if work is None else last_checkpoint(work))
    if last is None:
        return "; no training checkpoint was written, nothing to resume"
    given = parse_assignments(getattr(args, "set", None) or [])
    flags = [] if args.command == "recover" else ["resume"]  # a recovery follows a finished training
    if recovery is not None:
        flags.append("recover_resume")
    missing = [f"{flag}=true" for flag in flags if not parse_bool(flag, given.get(flag, "false"))]
    command = " ".join(shlex.quote(a) for a in ["moeify", *argv, *(x for f in missing for x in ("--set", f))])
    return f"; the last checkpoint is {last} (step {last.name.split('-')[-1]}); continue with: {command}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        with interruptible():
            return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"moeify {args.command}: interrupted{_resume_hint(args, argv)}", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        if args.debug:
            raise
        print(f"moeify {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the system refused a read or write: disk full, permissions, a vanished file
        if args.debug or error.errno is None:
            raise
        where = f" ({error.filename})" if error.filename else ""
        print(f"moeify {args.command}: error: {error.strerror or error}{where}; nothing was written to the output: "
              "free the space or fix the permission and run again", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
