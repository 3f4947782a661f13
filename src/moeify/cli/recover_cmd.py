"""``moeify recover``: a saved conversion distilled from its dense model for a budget of tokens."""

from __future__ import annotations

import argparse
import contextlib
import shutil
from pathlib import Path

from moeify.cli.common import add_device_arguments
from moeify.cli.format import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "recover", help="train a converted model further for a budget of tokens (LM loss or distillation)",
        description="Recover RUN (a folder moeify convert wrote) by training it on --calib for --tokens training "
                    "tokens, by distillation from its base model (the record's model, or --teacher) and the LM "
                    "loss, half of each by default (--set recover_lm_share=S: 0 distillation alone, 1 the LM loss "
                    "alone; half of each recovered text like the training text further than either at a matched "
                    "budget), measure it again against the dense model in the same run, and write the recovered "
                    "model with its record into --out (atomically; the run's own measurements are kept under "
                    "pre_recovery). What trains, the loss and the teacher are recover_* options (--set; `moeify "
                    "methods` lists them, the same as convert --set recover_*). Checkpoints go to <out>.work; "
                    "resume with --set recover_resume=true. Data-parallel: torchrun --nproc_per_node N -m moeify "
                    "recover ...")
    parser.add_argument("run_dir", type=Path, metavar="RUN", help="a converted model folder (moeify convert --out)")
    parser.add_argument("--tokens", type=int, required=True, help="training tokens of the recovery (recover_tokens)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (created atomically)")
    parser.add_argument("--calib", action="append", default=None,
                        help="training text, as for convert (default: the run's, when it is the embedded text; "
                             "a run keeps only its texts' names and digests)")
    parser.add_argument("--eval", default=None, help="held-out evaluation text (default: the run's, when embedded)")
    parser.add_argument("--teacher", default=None, help="the dense model to distil from (default: the run's base "
                                                        "model, record.json's model)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="recovery option recover_*=VALUE, repeatable")
    parser.add_argument("--milestones", default="", metavar="N,N",
                        help="also measure the perplexity after these many tokens (the record's curve)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the run's)")
    add_device_arguments(parser)
    parser.add_argument("--seq-len", type=int, default=None, help="evaluation window (default: the run's)")
    parser.add_argument("--no-speed", action="store_true", help="skip the dense-vs-MoE throughput measurement")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=run)


def parse_milestones(text: str) -> tuple[int, ...]:
    """``"50000,100000"`` -> ``(50000, 100000)``; each a positive whole number of tokens."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--milestones={text!r}: expected comma-separated token counts, e.g. 50000,100000") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"--milestones={text!r}: every count must be > 0")
    return values


def run(args: argparse.Namespace) -> int:
    import moeify
    from moeify.cli.convert_cmd import summary_rows, work_dir
    from moeify.files import check_free_disk, check_not_an_input, check_output_dir, output_lock
    from moeify.options import build_config, parse_assignments
    from moeify.training.recovery_options import RecoveryOptions

    options = parse_assignments(args.set)
    if "recover_tokens" in options:
        raise ValueError("give the budget as --tokens, not --set recover_tokens")
    unknown = sorted(k for k in options if not k.startswith("recover_"))
    if unknown:
        raise ValueError(f"recover takes recovery options (recover_*) only; got {', '.join(unknown)}")
    build_config(RecoveryOptions, {**options, "recover_tokens": args.tokens})  # refused before torch is imported
    milestones = parse_milestones(args.milestones)
    check_not_an_input(args.out, [args.run_dir, *(args.calib or []), args.eval, args.teacher])
    check_output_dir(args.out, args.overwrite)
    weights = sum(f.stat().st_size for f in Path(args.run_dir).glob("*.safetensors"))
    check_free_disk(args.out, weights, "the recovered model (as large as the conversion's weights)")
    from moeify.api.recover import recover_run
    from moeify.training.distributed import init_from_env, is_main

    init_from_env(args.device)
    work = work_dir(args.out)
    with output_lock(args.out) if is_main() else contextlib.nullcontext():
        result = recover_run(args.run_dir, {**options, "recover_tokens": args.tokens}, calib=args.calib, eval=args.eval,
                             teacher=args.teacher, seed=args.seed, device=args.device, dtype=args.dtype,
                             eval_seq_len=args.seq_len, measure_speed=not args.no_speed, work_dir=work,
                             milestones=milestones, progress=is_main())
        if not is_main():
            return 0
        out = moeify.save(result, args.out, overwrite=args.overwrite)
        shutil.rmtree(work, ignore_errors=True)
    print_table(f"moeify recover {args.run_dir}", summary_rows(result.record))
    for point in result.record["recovery"]["curve"]:
        apr = f", APR {point['apr']:.3f}" if "apr" in point else ""  # a point kept by an earlier moeify has none
        print(f"  after {point['tokens']:,} tokens: perplexity {point['ppl']:.3f}{apr}")
    print(f"wrote {out}/ (model, tokenizer, record.json)")
    return 0
