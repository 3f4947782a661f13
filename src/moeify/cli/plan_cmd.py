"""``moeify plan``: the estimated peak memory and work of a conversion, before anything heavy runs."""

from __future__ import annotations

import argparse
import json

from moeify.cli.common import add_layer_by_layer_argument
from moeify.cli.format import print_table
from moeify.presets import PRESETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan", help="estimate a conversion's peak memory from the model's config (no weights read)",
        description="Estimate the peak memory of `moeify convert MODEL --method M` by phase (dense evaluation, "
                    "calibration, training, MoE evaluation) from the model's config alone, and the work in "
                    "tokens x layers. MODEL may be a checkpoint, a GGUF file, a hub name or a preset shape: "
                    + ", ".join(PRESETS) + " (bfloat16 unless --dtype says otherwise). `convert` makes the same "
                    "estimate and stops at once when it exceeds the free memory.")
    parser.add_argument("model", nargs="?", default=None, help="checkpoint, GGUF file, hub name or preset")
    parser.add_argument("--method", default=None,
                        help="conversion method (default: the default method; `moeify methods` lists them)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="method option, repeatable")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="working dtype (default: the checkpoint's own)")
    parser.add_argument("--seq-len", type=int, default=None, help="evaluation window (default: the model's context)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the conversion runs (on the CPU a safetensors checkpoint stays memory-mapped)")
    add_layer_by_layer_argument(parser)
    parser.add_argument("--fsdp", type=int, default=1, metavar="N",
                        help="per process of a training sharded over N processes (`torchrun --nproc_per_node N "
                             "-m moeify convert --fsdp`; default 1: not sharded)")
    parser.add_argument("--table", action="store_true",
                        help="the table of docs/scaling.md: every method's peak on every preset shape, bfloat16 (with "
                             "--layer-by-layer: the methods that can, held one decoder layer at a time)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moeify.methods import DEFAULT_METHOD, get_method, method_configs
    from moeify.options import parse_assignments

    args.method = get_method(args.method or DEFAULT_METHOD).name  # an unknown name fails here, naming the methods
    if args.table:
        print(table(args.layer_by_layer))
        return 0
    options = parse_assignments(args.set)
    method_configs(args.method, options)  # a bad option is refused before torch is imported
    from moeify.memory_plan import plan

    memory = plan(args.model, args.method, options, dtype=args.dtype, eval_seq_len=args.seq_len,
                  device=args.device, layer_by_layer=args.layer_by_layer, shards=args.fsdp)
    record = memory.as_dict()
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    rows = [("parameters", f"{memory.shape.params / 1e9:.2f} B ({record['dtype']})"),
            ("process (Python, torch)", f"{record['process_gib']:.2f} GiB")]
    for phase, parts in record["phases_gib"].items():
        detail = ", ".join(f"{name} {value:.2f}" for name, value in parts.items() if value)
        rows.append((phase, f"{sum(parts.values()):.2f} GiB ({detail})"))
    rows.append(("peak", f"{record['peak_gib']:.2f} GiB ({record['peak_phase']})"))
    rows += [(name, f"{value:,}") for name, value in record["work"].items() if value]
    print_table(f"moeify plan {memory.shape.name} --method {args.method}", rows)
    return 0


def table(layer_by_layer: bool = False) -> str:
    """Markdown: the peak (GiB) of every method's default conversion of every preset shape in bfloat16 on one
    GPU (the checkpoint not memory-mapped); ``layer_by_layer``: of the methods that can, held that way."""
    from moeify.memory_plan import plan
    from moeify.methods import METHODS
    from moeify.planning import GIB

    methods = [m for m in METHODS if m.layer_by_layer or not layer_by_layer]
    lines = ["| model | params | " + " | ".join(m.name for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for name in PRESETS:
        plans = [plan(name, m.name, device="cuda", layer_by_layer=layer_by_layer) for m in methods]
        lines.append(f"| {name} | {plans[0].shape.params / 1e9:.2f} B | "
                     + " | ".join(f"{p.peak / GIB:.0f}" for p in plans) + " |")
    return "\n".join(lines)
