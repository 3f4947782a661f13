"""Time MoRE's spectral embedding: the top-r eigenvectors of a normalised co-activation graph by Lanczos
iterations (``moeify.moe.experts.spectral.top_eigenvectors``) against the dense decomposition
(``scipy.linalg.eigh`` of the r largest), at the graph sizes of MLP widths from SmolLM2's to a 7B model's.

The graph is built as MoRE builds it: binary markers of each token's top 10 % channels (``tokens`` random
tokens, each preferring one of r planted channel groups), co-activation counts over the tokens, diagonal
zeroed, scaled to D^-1/2 A D^-1/2. Each row records both times and how far apart the two subspaces are
(1 - the smallest cosine of their principal angles: k-means on the normalised rows sees only the subspace).
The lines are appended to ``--out``; ``--markdown`` prints the table of every line that file holds.

``--bound`` times the cluster-size bound that follows the clustering
(``moeify.moe.experts.spectral.bound_cluster_sizes``) in its worst case: every vertex but one per cluster
starts in one cluster, so nearly all of them move, one at a time (a dense random symmetric affinity); the
row names the commit it ran at.

    python benchmarks/bench_spectral.py [--sizes 1500,3000,6000] [--experts 8]
    python benchmarks/bench_spectral.py --bound [--sizes 9632] [--experts 7]
    python benchmarks/bench_spectral.py --markdown [--bound]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_file import append_row, git_commit, read_rows  # this folder is on sys.path when run

OUT = Path(__file__).resolve().parent / "results" / "bench_spectral.jsonl"


def normalised_graph(n: int, r: int, tokens: int, seed: int):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    group, preferred = rng.integers(0, r, n), rng.integers(0, r, tokens)
    scores = rng.standard_normal((tokens, n)).astype(np.float32) + 1.5 * (group[None, :] == preferred[:, None])
    marks = torch.zeros(tokens, n).scatter_(1, torch.from_numpy(scores).topk(n // 10, dim=1).indices, 1.0)
    a = (marks.T @ marks).double().numpy() / tokens
    np.fill_diagonal(a, 0.0)
    scale = 1.0 / np.sqrt(a.sum(axis=1))
    return scale[:, None] * a * scale[None, :]


def measure(n: int, r: int, tokens: int) -> dict:
    import numpy as np
    import scipy.linalg
    import torch

    from moeify.moe.experts.spectral import top_eigenvectors

    graph = normalised_graph(n, r, tokens, seed=0)
    began = time.perf_counter()
    dense = scipy.linalg.eigh(graph.copy(), subset_by_index=[n - r, n - 1], check_finite=False)[1]
    dense_s = time.perf_counter() - began
    began = time.perf_counter()
    lanczos = top_eigenvectors(graph.copy(), r, seed=0)
    lanczos_s = time.perf_counter() - began
    cosines = np.linalg.svd(dense.T @ lanczos, compute_uv=False)
    return {"bench": "spectral_embedding", "n": n, "r": r, "tokens": tokens, "dense_eigh_s": round(dense_s, 3),
            "lanczos_s": round(lanczos_s, 3), "speedup": round(dense_s / lanczos_s, 1),
            "subspace_gap": float(1 - cosines.min()), "threads": torch.get_num_threads()}


def measure_bound(n: int, r: int) -> dict:
    import numpy as np
    import torch

    from moeify.moe.experts.spectral import bound_cluster_sizes

    rng = np.random.default_rng(0)
    a = rng.random((n, n))
    a = (a + a.T) / 2
    labels = np.zeros(n, dtype=int)
    labels[:r] = np.arange(r)
    began = time.perf_counter()
    bound_cluster_sizes(labels, a, r, n // r, -(-n // r))
    seconds = time.perf_counter() - began
    commit = git_commit()
    return {"bench": "size_bound", "n": n, "r": r, "seconds": round(seconds, 3), "commit": commit,
            "threads": torch.get_num_threads()}


def markdown_bound(rows: list[dict]) -> str:
    lines = ["| n | r | moeify commit | seconds | threads |", "|---|---|---|---|---|"]
    lines += [f"| {r['n']:,} | {r['r']} | {r['commit']} | {r['seconds']:.2f} | {r['threads']} |" for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| graph size n | r | dense eigh s | Lanczos s | x faster | subspace gap | threads |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['n']:,} | {r['r']} | {r['dense_eigh_s']:.2f} | {r['lanczos_s']:.2f} | {r['speedup']:.1f} | "
              f"{r['subspace_gap']:.0e} | {r['threads']} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1500,3000,6000", help="graph sizes n, comma-separated")
    parser.add_argument("--experts", type=int, default=8, help="r: clusters, the eigenvectors kept")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens behind the counts")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--bound", action="store_true", help="time the cluster-size bound's worst case")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    bench = "size_bound" if args.bound else "spectral_embedding"
    if args.markdown:
        rows = [row for row in read_rows(args.out) if row["bench"] == bench]
        print(markdown_bound(rows) if args.bound else markdown(rows))
        return
    for n in (int(v) for v in args.sizes.split(",")):
        append_row(args.out, measure_bound(n, args.experts) if args.bound else measure(n, args.experts, args.tokens))


if __name__ == "__main__":
    main()
