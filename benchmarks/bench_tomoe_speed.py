"""Forward throughput of ToMoE's two inference modules against the dense model, measured in the same run.

LLaMA-shaped random model: hidden 1024, intermediate 2816, 4 layers, 16 heads of 64 dimensions,
vocabulary 512, batch 4 x 512. ``tomoe_mlp``: a ToMoE conversion with attention=off at p = 0.6 (top-1
MLP experts; two training steps only, since speed does not depend on what was learned);
``pruned_attention``: every attention with half the query/key RoPE pairs and per-token top-32 of 64
value/output dimensions (an untrained ``HeadDimRouter``). One row per model, appended to ``--out`` with
the run's ``--label`` (e.g. the moeify commit); ``--markdown`` prints the table of the file, each model's
tokens/s beside the dense model's of the same run.

    python benchmarks/bench_tomoe_speed.py [--label TEXT] [--out benchmarks/results/bench_tomoe_speed.jsonl]
    python benchmarks/bench_tomoe_speed.py --markdown
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from random_llama import HIDDEN, conversion_context, random_llama
from results_file import append_row, read_rows

from moeify.arch import DecoderAdapter
from moeify.evaluation.speed import forward_tokens_per_s
from moeify.methods.tomoe import TomoeConfig
from moeify.methods.tomoe.convert import convert
from moeify.moe.accounting import activated_parameters
from moeify.moe.attention.head_dim import pruned_attention, rope_pairs
from moeify.runtime.attention import HeadDimRouter

OUT = Path(__file__).resolve().parent / "results" / "bench_tomoe_speed.jsonl"


def measure(out: Path, label: str) -> None:
    dense = random_llama(4)
    ctx = conversion_context(dense)
    convert(ctx, TomoeConfig(attention="off", active_ratio=0.6, steps=2, batch_size=1, seq_len=64, calib_samples=1))
    mlp = ctx.model
    attention = copy.deepcopy(dense)
    adapter = DecoderAdapter(attention)
    for i in range(adapter.num_layers):
        router = HeadDimRouter(HIDDEN, 64, 128, top_k=32)
        adapter.replace_attention_(i, pruned_attention(adapter, i, rope_pairs(torch.arange(16), 64),
                                                       router=router))
    run = time.strftime("%Y-%m-%dT%H:%M:%S")
    with torch.no_grad():
        for name, model in (("dense", dense), ("tomoe_mlp", mlp), ("pruned_attention", attention)):
            append_row(out, {"run": run, "label": label, "model": name,
                             "apr": round(activated_parameters(model, measured=False).apr, 3),
                             "prefill_tokens_per_s": round(forward_tokens_per_s(model, 4, 512, repeats=3), 1)})


def markdown(out: Path) -> str:
    rows = read_rows(out)
    dense = {r["run"]: r["prefill_tokens_per_s"] for r in rows if r["model"] == "dense"}
    lines = ["| run | label | model | APR | prefill tokens/s (4 x 512) | x dense |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["model"] == "dense" else f"{r['prefill_tokens_per_s'] / dense[r['run']]:.2f}x"
        cells = (r["run"], r["label"], r["model"], r["apr"], r["prefill_tokens_per_s"], ratio)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--label", default="", help="what the run measured (e.g. the moeify commit)")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out), end="")
        return
    measure(args.out, args.label)


if __name__ == "__main__":
    main()
