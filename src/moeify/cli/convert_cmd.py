"""``moeify convert``: dense model -> MoE model folder + record.json, with a summary table."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from pathlib import Path

from moeify.cli.common import add_device_arguments, add_layer_by_layer_argument
from moeify.cli.format import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "convert", help="convert a dense model into an MoE model",
        description="Convert MODEL (a local folder or hub name; default: the embedded stories260K) with a "
                    "method, measure the dense and the MoE model on held-out text in the same run, and write "
                    "a loadable model folder with record.json into --out (atomically). Methods that train keep "
                    "resumable checkpoints in <out>.work beside it (removed once the model is saved). "
                    "Data-parallel training: torchrun --nproc_per_node N -m moeify convert ... (batch_size stays "
                    "the global batch, so the result does not depend on N; gloo on CPU, NCCL on GPUs); with --fsdp the "
                    "processes share the training's weights, gradients and optimizer state instead of each holding "
                    "them all.")
    parser.add_argument("model", nargs="?", default=None, help="local path or hub name (default: embedded)")
    parser.add_argument("--method", required=True, help="conversion method (see `moeify methods`)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (created atomically)")
    parser.add_argument("--calib", action="append", default=None,
                        help="calibration/training text: a .txt/.jsonl/.json/.parquet file or a folder of them; "
                             "repeatable (the texts joined); PATH:WEIGHT mixes the inputs in that ratio "
                             "(--calib a.txt:1 --calib b.jsonl:2: a third of the tokens from a.txt; no weight: 1); "
                             "more than 64 MiB is tokenised once into a cached, memory-mapped token file and "
                             "streamed (default: embedded TinyStories calibration slice)")
    parser.add_argument("--eval", action="append", default=None,
                        help="held-out evaluation text (default: embedded TinyStories evaluation slice, disjoint "
                             "from --calib); repeatable: the metrics use the first, a method's analysis all "
                             "(DSMoE: one heatmap row per file)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="method option, repeatable (see `moeify methods`)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    add_device_arguments(parser)
    parser.add_argument("--seq-len", type=int, default=None, help="evaluation window (default: model context)")
    parser.add_argument("--no-speed", action="store_true", help="skip the dense-vs-MoE throughput measurement")
    add_layer_by_layer_argument(parser)
    parser.add_argument("--no-memory-check", action="store_true",
                        help="convert even if `moeify plan`'s estimated peak exceeds the free memory")
    parser.add_argument("--fsdp", action="store_true",
                        help="under torchrun: shard the model, its gradients and the optimizer state over the "
                             "processes while training (FSDP2: a model whose training state does not fit one "
                             "device), instead of replicating them; the same steps either way")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=run)


def work_dir(out: Path) -> Path:
    """Where a conversion into ``out`` keeps its training checkpoints until the model is saved."""
    return out.with_name(out.name + ".work")


def run(args: argparse.Namespace) -> int:
    import moeify
    from moeify.files import check_not_an_input, check_output_dir, output_lock
    from moeify.methods import method_configs
    from moeify.options import parse_assignments

    options = parse_assignments(args.set)
    method_configs(args.method, options)  # a bad option is refused before torch is imported
    check_not_an_input(args.out, [args.model, *(args.calib or []), *(args.eval or [])])
    check_output_dir(args.out, args.overwrite)
    from moeify.training.distributed import init_from_env, is_main, launched

    if args.fsdp and not launched():
        raise ValueError("--fsdp shards training over processes: start moeify with torchrun --nproc_per_node N "
                         "(N >= 2)")
    init_from_env(args.device, fsdp=args.fsdp)  # under torchrun: every process converts, the training shares each batch
    work = work_dir(args.out)
    # a second convert into the same --out is refused, naming this one; under torchrun the main process holds it
    with output_lock(args.out) if is_main() else contextlib.nullcontext():
        result = moeify.convert(args.model, args.method, options, calib=args.calib, eval=args.eval,
                                seed=args.seed, device=args.device, dtype=args.dtype, eval_seq_len=args.seq_len,
                                measure_speed=not args.no_speed, progress=is_main(), work_dir=work,
                                check_memory=not args.no_memory_check, layer_by_layer=args.layer_by_layer,
                                out=args.out)
        if not is_main():
            return 0  # the main process writes and reports
        for warning in result.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        out = moeify.save(result, args.out, overwrite=args.overwrite)
        shutil.rmtree(work, ignore_errors=True)  # checkpoints are for resuming; the model is saved now
    print_table(f"moeify convert --method {result.record['method']}", summary_rows(result.record))
    print(f"wrote {out}/ (model, tokenizer, record.json{''.join(', ' + name for name in result.artifacts)})")
    return 0


def summary_rows(rec: dict) -> list[tuple[str, str]]:
    """The summary table of a record (``convert`` and ``recover`` print it)."""
    from moeify.evaluation.record import describe_change

    rows = [("dense perplexity", f"{rec['metrics']['dense_ppl']:.3f}")]
    recovery = rec.get("recovery")
    if recovery is not None:
        rows.append((f"{rec['method']} perplexity before recovery", f"{rec['pre_recovery']['ppl']:.3f}"))
    rows += [(f"{rec['method']} perplexity" + (" after recovery" if recovery else ""), f"{rec['metrics']['ppl']:.3f}"),
             ("perplexity change +- its sampling error",
              describe_change(rec["metrics"]["ppl_change"], rec["metrics"]["ppl_change_stderr"])),
             ("eval tokens", str(rec["metrics"]["eval_tokens"])),
             ("activated MLP ratio", f"{rec['active']['mlp_ratio']:.3f}"),
             ("activated param ratio (APR)", f"{rec['active']['apr']:.3f}"),
             (f"as the paper counts it ({rec['paper_ratio'].get('label', rec['paper_ratio']['kind'])})",
              f"{rec['paper_ratio']['value']:.3f}"),
             ("active / total params", f"{rec['active']['active_params']:,.0f} / {rec['active']['total_params']:,}"),
             ("conversion time", f"{rec['timings']['convert_s']:.1f} s")]
    if recovery is not None:
        rows.append(("recovery", f"{recovery['tokens']:,} tokens ({recovery['passes']} passes) in "
                                 f"{recovery['wall_s']:.0f} s, {recovery['trainable_params']:,} trainable params "
                                 f"({', '.join(recovery['parts'])}), teacher {recovery['teacher']}"))
    if "memory" in rec:
        memory = rec["memory"]
        rows.append(("peak memory", f"{memory['peak_rss_gib']:.2f} GiB resident (`moeify plan`: "
                                    f"{memory['plan_gib']:.2f} GiB, at {memory['plan_phase']})"))
    if rec["config"]["layer_by_layer"]:
        rows.append(("speed", "not measured (layer by layer: the model is never whole in memory)"))
    if rec["speed"]:
        s = rec["speed"]
        rows.append((f"tokens/s dense -> MoE ({s['batch_size']}x{s['seq_len']}, median of {s['repeats']})",
                     f"{s['dense_tokens_per_s']:,.0f} -> {s['tokens_per_s']:,.0f} ({s['speedup']:.2f}x; slowest - fastest "
                     f"run, of the median: dense {100 * s['spread']['dense']:.0f}%, MoE {100 * s['spread']['moe']:.0f}%)"))
    return rows
