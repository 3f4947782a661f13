"""``moeify bench``: prefill and decode throughput of a converted model against its dense model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moeify.cli.common import add_device_arguments
from moeify.cli.format import print_table

BENCH_KEY = "bench"  # the block of a run's record.json that holds its latest bench
PREFILL_SHAPES = ((1, 256), (8, 256), (1, 2048))  # (batch, tokens): one prompt, a batch of them, a long one
DECODE_BATCH_SIZES = (1, 32)  # one user; a serving batch


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench", help="measure MoE vs dense speed in one process",
        description="Prefill tokens/s at several (batch x tokens) shapes and greedy decoding tokens/s with the KV "
                    "cache at several batch sizes (the prompt's prefill left out) of MODEL_OR_DIR and of the dense "
                    "model it came from (--against, default: the model named in its record.json, or a standard "
                    "export's moeify_export.json), measured in the same process, each shape dense then MoE: "
                    "warm-up, then the median of repeats with its spread ((slowest - fastest) / median), timed "
                    "with CUDA synchronisation on a GPU. --compile runs both models through torch.compile alike. "
                    "Also prints the ideal speed-up from multiply-accumulate counts and the peak memory; a run "
                    "folder's record.json keeps the results (`moeify report` shows them).")
    parser.add_argument("model", help="converted folder (or any model)")
    parser.add_argument("--against", default=None, help="dense model (default: from record.json or moeify_export.json)")
    parser.add_argument("--prefill", default=None,
                        help=f"prefill shapes BATCHxTOKENS, comma-separated (default {_text(PREFILL_SHAPES)}, less the "
                             "shapes longer than the model's context)")
    decode = ",".join(map(str, DECODE_BATCH_SIZES))
    parser.add_argument("--decode", default=decode, help=f"decode batch sizes, comma-separated (default {decode})")
    parser.add_argument("--prompt-len", type=int, default=256, help="decode prompt length (default 256)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per sequence, >= 2 (default 32)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed prefill repeats after warm-up; decoding takes half as many (default 5)")
    parser.add_argument("--compile", action="store_true",
                        help="compile both models with torch.compile(fullgraph=True), CUDA graphs on a GPU, and "
                             "decode through transformers' static KV cache; needs --dtype bfloat16 (torch compiles "
                             "the experts' grouped matmul in bfloat16 only). Compiling takes minutes on a CPU")
    add_device_arguments(parser)
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results to this JSON file (an existing one only with --overwrite); "
                             "rewritten after each shape, marked \"partial\" until the last is done")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    parser.set_defaults(run=run)


def _text(shapes: tuple[tuple[int, int], ...]) -> str:
    """``((1, 256), (8, 256))`` -> ``"1x256,8x256"``: the form --prefill takes."""
    return ",".join(f"{batch}x{tokens}" for batch, tokens in shapes)


def _integers(text: str, flag: str, example: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated integers, e.g. {example}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} is out of range; allowed: integers >= 1")
    return values


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"1x256,8x256"`` -> [(1, 256), (8, 256)]; every number a positive integer."""
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        batch, _, tokens = part.partition("x")
        if not (batch.isdigit() and tokens.isdigit()) or min(int(batch), int(tokens)) < 1:
            raise ValueError(f"--prefill={text!r}: {part!r} is not BATCHxTOKENS with both >= 1, e.g. 8x256")
        shapes.append((int(batch), int(tokens)))
    if not shapes:
        raise ValueError(f"--prefill={text!r} names no shape; e.g. 1x256,8x256")
    return shapes


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


def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed table: one row per prefill shape and decode batch size, then the ideal and the memory."""
    def cell(p: dict[str, Any]) -> str:
        return f"{p['dense']:,.0f} -> {p['moe']:,.0f} ({p['speedup']:.2f}x; spread {max(p['spread'].values()):.0%})"

    table = [(f"prefill {p['batch_size']}x{p['seq_len']} tokens/s", cell(p)) for p in result["prefill"]]
    table += [(f"decode b={d['batch_size']} tokens/s", cell(d)) for d in result["decode"]]
    return table + [("ideal speed-up (MAC counts)", f"{result['ideal_speedup']:.2f}x"),
                    ("peak memory", result["peak_memory"])]


def _keep_in_record(folder: Path, result: dict[str, Any]) -> None:
    """The results as the ``bench`` block of a run folder's record.json (the latest bench, eager or compiled
    each in its own slot), rewritten atomically."""
    from moeify.evaluation.record import RECORD_NAME
    from moeify.files import write_output_file

    path = folder / RECORD_NAME
    record = json.loads(path.read_text())
    record.setdefault(BENCH_KEY, {})["compiled" if result["compiled"] else "eager"] = result
    write_output_file(path, json.dumps(record, indent=2, default=str) + "\n")


def run(args: argparse.Namespace) -> int:
    import moeify
    from moeify.evaluation.bench import benchmark_pair
    from moeify.evaluation.record import RECORD_NAME
    from moeify.files import check_output_file, write_output_file

    prefill = _shapes(args.prefill or _text(PREFILL_SHAPES))
    decode = _integers(args.decode, "--decode", "1,32")
    for name, least in (("prompt_len", 1), ("new_tokens", 2), ("repeats", 1)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is out of range; allowed: >= {least}")
    if args.compile and args.dtype not in (None, "bfloat16"):
        raise ValueError(f"--compile needs --dtype bfloat16, not {args.dtype}: torch compiles the experts' grouped "
                         "matmul in bfloat16 only")
    against = args.against if args.against is not None else _dense_model(Path(args.model))
    if args.json:
        check_output_file(args.json, args.overwrite, [args.model, against])
    moe, _ = moeify.load_model(args.model, args.device, args.dtype)
    limit = getattr(moe.config, "max_position_embeddings", None)
    if args.prefill is None and limit is not None and (longer := [s for s in prefill if s[1] > limit]):
        prefill = [s for s in prefill if s[1] <= limit]  # the defaults fit the model; asked-for shapes must
        print(f"prefill {', '.join(f'{b}x{t}' for b, t in longer)} left out: longer than the model's {limit} positions")
    dense, _ = moeify.load_model(against, args.device, args.dtype)

    def keep_partial(rows: dict[str, Any]) -> None:  # the shapes done so far, should the run be cut short
        write_output_file(args.json, json.dumps({**rows, "partial": True}, indent=2) + "\n")

    result = benchmark_pair(dense, moe, prefill, decode, args.prompt_len, args.new_tokens, args.repeats,
                            compile=args.compile, measured=keep_partial if args.json else None)
    mode = "compiled" if args.compile else "eager"
    print_table(f"moeify bench {args.model} vs {against} ({mode}, {result['device']})", rows(result))
    if (Path(args.model) / RECORD_NAME).is_file():
        _keep_in_record(Path(args.model), result)
        print(f"kept in {Path(args.model) / RECORD_NAME} ({BENCH_KEY}.{mode})")
    if args.json:
        write_output_file(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
