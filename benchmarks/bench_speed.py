"""Forward throughput of a CMoE-converted model against its dense model, measured in the same run.

LLaMA-shaped random model: hidden 1024, intermediate 2816, 8 layers, 16 heads, vocabulary 512 (the
embedded tokenizer's, so that the LM head does not dominate), batch 8 x 512, CMoE S1A1E8 (1 shared + 7
routed experts, top-1: 25 % of the MLP active). Prints one JSON line with the measured and the ideal
(FLOP-count) speed-up.

    python benchmarks/bench_speed.py [--layers 8] [--batch 8] [--seq 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from random_llama import HIDDEN, INTERMEDIATE, VOCAB, conversion_context, random_llama, shape

from moeify.evaluation.speed import forward_tokens_per_s
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.moe.accounting import activated_parameters


def flops_per_token(hidden: int, inter: int, layers: int, seq: int, vocab: int, mlp_ratio: float) -> float:
    """Multiply-accumulates per token: projections, attention scores (causal average), MLP, LM head."""
    attn = 4 * hidden * hidden + seq * hidden  # q,k,v,o + (QK^T and AV over seq/2 keys on average)
    return layers * (attn + 3 * hidden * inter * mlp_ratio) + hidden * vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec", default="S1A1E8")
    args = parser.parse_args()
    dense = random_llama(args.layers)
    ctx = conversion_context(dense)
    start = time.perf_counter()
    convert(ctx, CmoeConfig(spec=args.spec, calib_samples=8, seq_len=512))
    convert_s = time.perf_counter() - start
    dense_tps = forward_tokens_per_s(dense, args.batch, args.seq, repeats=args.repeats, warmup=1)
    moe_tps = forward_tokens_per_s(ctx.model, args.batch, args.seq, repeats=args.repeats, warmup=1)
    ratio = activated_parameters(ctx.model, measured=False).mlp_ratio
    ideal = flops_per_token(HIDDEN, INTERMEDIATE, args.layers, args.seq, VOCAB, 1.0) / \
        flops_per_token(HIDDEN, INTERMEDIATE, args.layers, args.seq, VOCAB, ratio)
    print(json.dumps({"bench": "forward_speed", "shape": shape(args.layers),
                      "batch": args.batch, "seq": args.seq, "spec": args.spec, "mlp_ratio": round(ratio, 4),
                      "dense_tokens_per_s": round(dense_tps, 1), "moe_tokens_per_s": round(moe_tps, 1),
                      "speedup": round(moe_tps / dense_tps, 3), "ideal_speedup_flops": round(ideal, 3),
                      "convert_s": round(convert_s, 1), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
