"""DSMoE on stories260K with the default training budget: the tau sweep (Appendix A, Table 4) and the
STE ablation at matched activated ratio (Table 3's direction), on held-out TinyStories text.

For each variant (default ``full`` and ``no_ste``) and each sparsity-loss weight (default 1, 0.1, 0.01)
one model is trained with the method's defaults otherwise (minutes each on a 2-core CPU) and measured at
tau = 0.5 and over the tau sweep of its record. The variants are then compared at matched activated MLP
ratio: each run's perplexity against the other variant's ratio-perplexity frontier (its runs at the
different weights, log-perplexity interpolated linearly in the ratio; null outside the frontier's
range). Held-out text: the paragraphs of ../shared's TinyStories dev file after the 567 embedded in
the package (the training text is the embedded calibration slice). Prints one JSON object per line.

    python benchmarks/bench_dsmoe.py [--variants full,no_ste] [--weights 1,0.1,0.01] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np

import moeify
from moeify.methods.options import parse_assignments

SHARED = Path(__file__).resolve().parents[2] / "shared" / "assets" / "data" / "tinystories"
EMBEDDED_PARAGRAPHS = 567


def held_out_file(folder: Path, paragraphs: int) -> Path:
    text = (SHARED / "tinystories_valid_dev.txt").read_text()
    path = folder / "tinystories_heldout.txt"
    path.write_text("\n\n".join(text.split("\n\n")[EMBEDDED_PARAGRAPHS:][:paragraphs]))
    return path


def run(options: dict[str, str], held_out: Path, seed: int) -> dict:
    record = moeify.convert(None, "dsmoe", options, eval=held_out, seed=seed, measure_speed=False).record
    training, analysis = record["details"]["training"], record["details"]["analysis"]
    ratios = [row["mlp_ratio"] for row in analysis["tau_sweep"]]
    return {
        "variant": record["config"]["variant"], "sparsity_weight": record["config"]["sparsity_weight"],
        "config": record["config"], "convert_s": round(record["timings"]["convert_s"], 1),
        "s_per_step": round(record["timings"]["convert_s"] / training["steps"], 3),
        "first_lm": training["first_lm"], "last_lm": training["last_lm"], "last_sparsity": training["last_sparsity"],
        "dense_ppl": record["metrics"]["dense_ppl"], "ppl": record["metrics"]["ppl"],
        "mlp_ratio": record["active"]["mlp_ratio"], "apr": record["active"]["apr"],
        "experts_per_layer": analysis["activated_experts"]["per_file"],
        "table4": [{k: row[k] for k in ("tau", "ppl", "apr", "mlp_ratio")} for row in analysis["tau_sweep"]],
        "sweep_monotone": all(a >= b for a, b in zip(ratios, ratios[1:])),
    }


def ppl_at_ratio(frontier: list[dict], ratio: float) -> float | None:
    """Perplexity at an activated MLP ratio, log-linear between the frontier's runs; None outside them."""
    points = sorted((r["mlp_ratio"], math.log(r["ppl"])) for r in frontier)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return None if not xs[0] <= ratio <= xs[-1] else float(math.exp(np.interp(ratio, xs, ys)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="full,no_ste")
    parser.add_argument("--weights", default="1,0.1,0.01", help="sparsity-loss weights")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paragraphs", type=int, default=600, help="held-out paragraphs")
    args = parser.parse_args()
    options = parse_assignments(args.set)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        held_out = held_out_file(Path(tmp), args.paragraphs)
        for variant in args.variants.split(","):
            for weight in args.weights.split(","):
                result = run({**options, "variant": variant, "sparsity_weight": weight}, held_out, args.seed)
                runs.setdefault(variant, []).append(result)
                print(json.dumps(result), flush=True)
    for variant, results in runs.items():
        for result in results:
            matched = {other: ppl_at_ratio(frontier, result["mlp_ratio"]) for other, frontier in runs.items()
                       if other != variant}
            print(json.dumps({"matched": variant, "sparsity_weight": result["sparsity_weight"],
                              "mlp_ratio": result["mlp_ratio"], "ppl": result["ppl"], "others_at_ratio": matched}),
                  flush=True)


if __name__ == "__main__":
    main()
