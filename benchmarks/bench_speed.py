"""Forward throughput of a CMoE-converted model against its dense model, measured in the same run.

LLaMA-shaped random model: hidden 1024, intermediate 2816, 8 layers, 16 heads, vocabulary 512 (the
embedded tokenizer's, so that the LM head does not dominate), batch 8 x 512, CMoE S1A1E8 (1 shared + 7
routed experts, top-1: 25 % of the MLP active). Measures prefill tokens/s of the dense model, of the MoE
model on its packed inference path and on its per-expert path (each expert's own modules, what training
runs), with each measurement's spread ((slowest - fastest) / median of the timed passes: a busy machine
shows there), beside the ideal (FLOP-count) speed-up. Prints one JSON line, appended to ``--out``;
``--markdown`` prints the table of every run that file holds.

    python benchmarks/bench_speed.py [--layers 8] [--batch 8] [--seq 512] [--repeats 3]
        [--out benchmarks/results/bench_speed.jsonl]
    python benchmarks/bench_speed.py --markdown
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_file import append_row, read_rows  # this folder is on sys.path when run

OUT = Path(__file__).resolve().parent / "results" / "bench_speed.jsonl"


def flops_per_token(hidden: int, inter: int, layers: int, seq: int, vocab: int, mlp_ratio: float) -> float:
    """Multiply-accumulates per token: projections, attention scores (causal average), MLP, LM head."""
    attn = 4 * hidden * hidden + seq * hidden  # q,k,v,o + (QK^T and AV over seq/2 keys on average)
    return layers * (attn + 3 * hidden * inter * mlp_ratio) + hidden * vocab


def measure(args: argparse.Namespace) -> dict:
    """Convert the random model and time dense, packed MoE and per-expert MoE prefill; the JSON row."""
    import torch
    from bench_export_layout import per_expert_path  # this folder is on sys.path when run
    from random_llama import HIDDEN, INTERMEDIATE, VOCAB, conversion_context, random_llama, shape

    from moeify.evaluation.speed import forward_speed
    from moeify.methods.cmoe import CmoeConfig
    from moeify.methods.cmoe.convert import convert
    from moeify.moe.accounting import activated_parameters
    from moeify.options import build_config

    dense = random_llama(args.layers)
    ctx = conversion_context(dense)
    start = time.perf_counter()
    convert(ctx, build_config(CmoeConfig, {"spec": args.spec, "calib_samples": 8, "seq_len": 512, "analysis": False}))
    convert_s = time.perf_counter() - start
    timing = {"repeats": args.repeats, "warmup": 1}
    with torch.no_grad():
        dense_tps, dense_spread = forward_speed(dense, args.batch, args.seq, **timing)
        moe_tps, moe_spread = forward_speed(ctx.model, args.batch, args.seq, **timing)
        with per_expert_path():
            per_expert_tps, per_expert_spread = forward_speed(ctx.model, args.batch, args.seq, **timing)
    ratio = activated_parameters(ctx.model, measured=False).mlp_ratio
    ideal = flops_per_token(HIDDEN, INTERMEDIATE, args.layers, args.seq, VOCAB, 1.0) / \
        flops_per_token(HIDDEN, INTERMEDIATE, args.layers, args.seq, VOCAB, ratio)
    return {"bench": "forward_speed", "shape": shape(args.layers), "batch": args.batch, "seq": args.seq,
            "spec": args.spec, "mlp_ratio": round(ratio, 4), "repeats": args.repeats,
            "dense_tokens_per_s": round(dense_tps, 1), "moe_tokens_per_s": round(moe_tps, 1),
            "moe_per_expert_tokens_per_s": round(per_expert_tps, 1),
            "speedup": round(moe_tps / dense_tps, 3), "per_expert_speedup": round(per_expert_tps / dense_tps, 3),
            "ideal_speedup_flops": round(ideal, 3),
            "spread": {"dense": round(dense_spread, 3), "moe": round(moe_spread, 3),
                       "moe_per_expert": round(per_expert_spread, 3)},
            "convert_s": round(convert_s, 1), "threads": torch.get_num_threads()}


def markdown(path: Path) -> str:
    """The table of every run in ``path``."""
    lines = [("| model | CMoE spec (MLP share) | batch | dense tokens/s | MoE tokens/s (x dense) | "
              "MoE per-expert path tokens/s (x dense) | FLOP-ideal x dense | spread dense / MoE / per-expert |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in read_rows(path):
        spread = " / ".join(f"{100 * r['spread'][k]:.0f} %" for k in ("dense", "moe", "moe_per_expert"))
        lines.append(f"| {r['shape']} | {r['spec']} ({r['mlp_ratio']:.2f}) | {r['batch']} x {r['seq']} | "
                     f"{r['dense_tokens_per_s']:.1f} | {r['moe_tokens_per_s']:.1f} ({r['speedup']:.2f}x) | "
                     f"{r['moe_per_expert_tokens_per_s']:.1f} ({r['per_expert_speedup']:.2f}x) | "
                     f"{r['ideal_speedup_flops']:.2f}x | {spread} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec", default="S1A1E8")
    parser.add_argument("--out", type=Path, default=OUT, help="results file the JSON line is appended to")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    append_row(args.out, measure(args))


if __name__ == "__main__":
    main()
