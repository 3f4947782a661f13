"""Forward throughput of ToMoE's two inference modules against the dense model, measured in the same run.

LLaMA-shaped random model: hidden 1024, intermediate 2816, 4 layers, 16 heads of 64 dimensions,
vocabulary 512, batch 4 x 512. ``tomoe_mlp``: a ToMoE conversion with attention=off at p = 0.6 (top-1
MLP experts; two training steps only, since speed does not depend on what was learned);
``pruned_attention``: every attention with half the query/key RoPE pairs and per-token top-32 of 64
value/output dimensions (an untrained ``HeadDimRouter``). Prints one JSON line per model.

    python benchmarks/bench_tomoe_speed.py
"""

from __future__ import annotations

import copy
import json

import torch
from random_llama import HIDDEN, conversion_context, random_llama

from moeify.arch import DecoderAdapter
from moeify.evaluation.speed import forward_tokens_per_s
from moeify.methods.tomoe import TomoeConfig
from moeify.methods.tomoe.convert import convert
from moeify.moe.accounting import activated_parameters
from moeify.moe.attention.head_dim import pruned_attention, rope_pairs
from moeify.runtime.attention import HeadDimRouter


def main() -> None:
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
    with torch.no_grad():
        for name, model in (("dense", dense), ("tomoe_mlp", mlp), ("pruned_attention", attention)):
            print(json.dumps({"model": name, "apr": round(activated_parameters(model, measured=False).apr, 3),
                              "prefill_tokens_per_s": round(forward_tokens_per_s(model, 4, 512, repeats=3), 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
