"""Benchmark the exact balanced assignment against the CMoE paper's Jonker-Volgenant formulation.

CMoE (Eq. 11-13) assigns n neurons to k equal clusters by repeating each of the k centroid
columns `capacity` times and solving the n x n assignment with scipy's linear_sum_assignment.
`moeify.moe.experts.balanced_assignment` solves the same transportation problem as a min-cost flow. This
script times both on the paper's shape (n = 9632 routed neurons, k = 14 clusters, capacity 688)
with realistic costs, checks that the optimal costs agree and prints one JSON line.

Costs: every neuron is described by a binary activation-marker vector over `dim` calibration tokens
(as in CMoE's ATopK representation, with per-neuron firing rates), the centroids are the means of k
random neuron groups, and the cost is the L2 distance, computed in float32 with torch.cdist the way
a k-means loop would.

The line is appended to ``--out``; ``--markdown`` prints the table of every line that file holds.

    python benchmarks/bench_balanced_assignment.py [--n 9632] [--k 14] [--dim 512] [--repeats 5]
        [--out benchmarks/results/bench_balanced_assignment.jsonl]
    python benchmarks/bench_balanced_assignment.py --markdown
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from results_file import append_row, read_rows  # this folder is on sys.path when run

if TYPE_CHECKING:
    import torch

OUT = Path(__file__).resolve().parent / "results" / "bench_balanced_assignment.jsonl"


def make_distances(n: int, k: int, dim: int, seed: int) -> torch.Tensor:
    """L2 distances (n, k) from binary neuron features to the means of k random neuron groups."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    firing_rate = torch.rand(n, 1, generator=generator) * 0.5
    features = (torch.rand(n, dim, generator=generator) < firing_rate).float()
    groups = torch.randperm(n, generator=generator) % k
    centroids = torch.stack([features[groups == j].mean(dim=0) for j in range(k)])
    return torch.cdist(features, centroids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=9632, help="number of rows (neurons)")
    parser.add_argument("--k", type=int, default=14, help="number of clusters; must divide n")
    parser.add_argument("--dim", type=int, default=512, help="feature length (calibration tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of balanced_assignment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT, help="results file the JSON line is appended to")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return 0
    if args.n % args.k:
        parser.error(f"--k={args.k} must divide --n={args.n}")
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    try:
        from moeify.moe.experts.balanced_assignment import balanced_assignment
    except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from moeify.moe.experts.balanced_assignment import balanced_assignment

    capacity = args.n // args.k

    distances = make_distances(args.n, args.k, args.dim, args.seed)
    costs = distances.double().numpy()
    rows = np.arange(args.n)

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        labels = balanced_assignment(distances, capacity).numpy()
        times.append(time.perf_counter() - start)
    if not (np.bincount(labels, minlength=args.k) == capacity).all():
        raise AssertionError("balanced_assignment returned clusters of the wrong size")
    cost_ours = float(costs[rows, labels].sum())

    start = time.perf_counter()
    extended = np.repeat(costs, capacity, axis=1)
    lsa_rows, lsa_cols = linear_sum_assignment(extended)
    scipy_s = time.perf_counter() - start
    cost_scipy = float(extended[lsa_rows, lsa_cols].sum())

    ours_s = statistics.median(times)
    agree = abs(cost_ours - cost_scipy) <= 1e-9 * abs(cost_scipy)
    row = {"bench": "balanced_assignment", "n": args.n, "k": args.k, "dim": args.dim, "repeats": args.repeats,
           "ours_s": round(ours_s, 4), "scipy_lsa_s": round(scipy_s, 2), "speedup": round(scipy_s / ours_s, 1),
           "cost_ours": cost_ours, "cost_scipy": cost_scipy, "costs_agree": agree}
    append_row(args.out, row)
    return 0 if agree else 1


def markdown(path: Path) -> str:
    """The table of every line of ``path``."""
    lines = [("| neurons n | clusters k (capacity) | balanced_assignment s (median of repeats) | "
              "scipy linear_sum_assignment on the n x n matrix, s | x faster | same optimal cost |"),
             "|---|---|---|---|---|---|"]
    for r in read_rows(path):
        lines.append(f"| {r['n']:,} | {r['k']} ({r['n'] // r['k']}) | {r['ours_s']:.3f} ({r['repeats']}) | "
                     f"{r['scipy_lsa_s']:.1f} | {r['speedup']:,.0f} | {'yes' if r['costs_agree'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
