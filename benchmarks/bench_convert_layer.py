"""CMoE conversion time of one decoder MLP at the LLaMA-2-7B shape on this CPU.

d = 4096, d_h = 11008, 8 x 2048 calibration tokens (the paper's setting). The paper's
7B runs use S2A2E16 and S1A1E8; we time S1A1E8 (7 routed experts of 1376 neurons) and S2A2E16 (14 routed
experts of 688: the balanced-assignment shape n = 9632, k = 14). Weights and activations are random
(timing only). Prints one JSON line per spec with the time of each stage.

    python benchmarks/bench_convert_layer.py [--tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moeify.arch.mlp import MlpWeights
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import atopk_markers, build_layer, carve
from moeify.options import build_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--specs", default="S1A1E8,S2A2E16")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    d, d_h = 4096, 11008
    mlp = MlpWeights(up=torch.randn(d_h, d, generator=g) * 0.02, gate=torch.randn(d_h, d, generator=g) * 0.02,
                     down=torch.randn(d, d_h, generator=g) * 0.02, act="silu")
    x = torch.randn(args.tokens, d, generator=g)
    for spec in args.specs.split(","):
        cfg = build_config(CmoeConfig, {"spec": spec})
        t0 = time.perf_counter()
        markers = atopk_markers(mlp, x, cfg.ka)
        t1 = time.perf_counter()
        carving = carve(markers, cfg, torch.Generator().manual_seed(0))
        t2 = time.perf_counter()
        build_layer(mlp, carving, cfg)
        t3 = time.perf_counter()
        print(json.dumps({"bench": "cmoe_convert_layer", "shape": "llama-2-7b mlp 4096x11008", "spec": spec,
                          "calib_tokens": args.tokens, "profiling_s": round(t1 - t0, 2),
                          "kmeans_s": round(t2 - t1, 2), "kmeans_iterations": carving.iterations,
                          "build_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2),
                          "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
