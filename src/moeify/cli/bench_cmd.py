"""``moeify bench``: prefill and decode throughput of a converted model against its dense model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeify.cli.common import add_device_arguments
from moeify.cli.format import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench", help="measure MoE vs dense speed in one process",
        description="Prefill tokens/s at several batch sizes and decode tokens/s (greedy, KV cache) of "
                    "MODEL_OR_DIR and of the dense model it came from (--against, default: the model named in "
                    "its record.json, or a standard export's moeify_export.json), measured in the same "
                    "process: warm-up, then the median of repeats. "
                    "Also prints the ideal speed-up from multiply-accumulate counts and the peak memory.")
    parser.add_argument("model", help="converted folder (or any model)")
    parser.add_argument("--against", default=None, help="dense model (default: from record.json or moeify_export.json)")
    parser.add_argument("--batch-sizes", default="1,8", help="prefill batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--seq-len", type=int, default=256, help="prefill length and decode prompt (default 256)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode tokens per sequence (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats after warm-up (default 5)")
    add_device_arguments(parser)
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results to this JSON file (an existing one only with --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    parser.set_defaults(run=run)


def _batch_sizes(text: str) -> list[int]:
    """``"1,8"`` -> [1, 8]; every size a positive integer."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes={text!r} must be comma-separated integers, e.g. 1,8") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes={text!r} is out of range; allowed: integers >= 1")
    return sizes


def _dense_model(folder: Path) -> str:
    """The dense model a converted folder (its record.json) or a standard export (its moeify_export.json)
    came from."""
    from moeify.evaluation.record import RECORD_NAME
    from moeify.export.hf_export import EXPORT_RECORD

    for name, key in ((RECORD_NAME, "model"), (EXPORT_RECORD, "dense_model")):
        if (path := folder / name).is_file() and key in (record := json.loads(path.read_text())):
            return record[key]
    raise ValueError(f"{folder} has no {RECORD_NAME} (nor an export record naming the dense model); pass the dense "
                     "model with --against")


def run(args: argparse.Namespace) -> int:
    import moeify
    from moeify.evaluation.bench import benchmark_pair
    from moeify.files import check_output_file, write_output_file

    sizes = _batch_sizes(args.batch_sizes)
    for name in ("seq_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is out of range; allowed: >= 1")
    against = args.against if args.against is not None else _dense_model(Path(args.model))
    if args.json:
        check_output_file(args.json, args.overwrite, [args.model, against])
    moe, _ = moeify.load_model(args.model, args.device, args.dtype)
    dense, _ = moeify.load_model(against, args.device, args.dtype)
    result = benchmark_pair(dense, moe, sizes, args.seq_len, args.new_tokens, args.repeats)
    rows = [(f"prefill b={p['batch_size']} tokens/s", f"{p['dense']:,.0f} -> {p['moe']:,.0f} ({p['speedup']:.2f}x)")
            for p in result["prefill"]]
    d = result["decode"]
    rows.append((f"decode b={d['batch_size']} tokens/s", f"{d['dense']:,.0f} -> {d['moe']:,.0f} ({d['speedup']:.2f}x)"))
    rows.append(("ideal speed-up (MAC counts)", f"{result['ideal_speedup']:.2f}x"))
    rows.append(("peak memory", result["peak_memory"]))
    print_table(f"moeify bench {args.model} vs {against}", rows)
    if args.json:
        write_output_file(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
