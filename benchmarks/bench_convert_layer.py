"""CMoE conversion time of one decoder MLP at the LLaMA-2-7B shape on this CPU.

d = 4096, d_h = 11008, 8 x 2048 calibration tokens (the paper's setting). The paper's
7B runs use S2A2E16 and S1A1E8; we time S1A1E8 (7 routed experts of 1376 neurons) and S2A2E16 (14 routed
experts of 688: the balanced-assignment shape n = 9632, k = 14). Weights and activations are random
(timing only). Prints one JSON line per spec with the time of each stage, appended to ``--out``;
``--markdown`` prints the table of every line that file holds.

    python benchmarks/bench_convert_layer.py [--tokens 16384] [--specs S1A1E8,S2A2E16]
        [--out benchmarks/results/bench_convert_layer.jsonl]
    python benchmarks/bench_convert_layer.py --markdown
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_file import append_row, read_rows  # this folder is on sys.path when run

OUT = Path(__file__).resolve().parent / "results" / "bench_convert_layer.jsonl"


def measure(tokens: int, specs: str, out: Path) -> None:
    """Time each spec's profiling, carving (balanced k-means) and layer build; print and append each row."""
    import torch

    from moeify.arch.mlp import MlpWeights
    from moeify.methods.cmoe import CmoeConfig
    from moeify.methods.cmoe.convert import atopk_markers, build_layer, carve
    from moeify.options import build_config

    g = torch.Generator().manual_seed(0)
    d, d_h = 4096, 11008
    mlp = MlpWeights(up=torch.randn(d_h, d, generator=g) * 0.02, gate=torch.randn(d_h, d, generator=g) * 0.02,
                     down=torch.randn(d, d_h, generator=g) * 0.02, act="silu")
    x = torch.randn(tokens, d, generator=g)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in specs.split(","):
        cfg = build_config(CmoeConfig, {"spec": spec})
        t0 = time.perf_counter()
        markers = atopk_markers(mlp, x, cfg.ka)
        t1 = time.perf_counter()
        carving = carve(markers, cfg, torch.Generator().manual_seed(0))
        t2 = time.perf_counter()
        build_layer(mlp, carving, cfg)
        t3 = time.perf_counter()
        row = {"bench": "cmoe_convert_layer", "shape": "llama-2-7b mlp 4096x11008", "spec": spec,
               "calib_tokens": tokens, "profiling_s": round(t1 - t0, 2),
               "kmeans_s": round(t2 - t1, 2), "kmeans_iterations": carving.iterations,
               "build_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2),
               "threads": torch.get_num_threads()}
        append_row(out, row)


def markdown(path: Path) -> str:
    """The table of every line of ``path``."""
    lines = [("| MLP shape | spec | calibration tokens | total s | profiling s | balanced k-means s (iterations) | "
              "build s | threads |"), "|---|---|---|---|---|---|---|---|"]
    for r in read_rows(path):
        lines.append(f"| {r['shape']} | {r['spec']} | {r['calib_tokens']:,} | {r['total_s']:.1f} | "
                     f"{r['profiling_s']:.1f} | {r['kmeans_s']:.1f} ({r['kmeans_iterations']}) | {r['build_s']:.1f} | "
                     f"{r['threads']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--specs", default="S1A1E8,S2A2E16")
    parser.add_argument("--out", type=Path, default=OUT, help="results file the JSON lines are appended to")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    measure(args.tokens, args.specs, args.out)


if __name__ == "__main__":
    main()
