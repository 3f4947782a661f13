"""DSMoE on stories260K with the default training budget: the tau sweep (Appendix A, Table 4) and the
STE ablation at matched activated ratio (Table 3's direction), on held-out TinyStories text.

For each variant (default ``full`` and ``no_ste``) and each sparsity-loss weight (default 1, as Eq. 19)
one model is trained with the method's defaults otherwise (minutes each on a 2-core CPU), measured at
tau = 0.5, over the tau sweep of its record, and over a fine sweep (tau from 0 to 0.95 in steps of
0.05, the step of §6.2, and 0.51 ... 0.59, where the gates of a short run cluster). Because tau = 0
switches every expert on and tau = 1 (almost) every one off, a fine sweep covers every activated ratio:
each run's perplexity at its own ratio is compared with every other run's perplexity at that same ratio,
log-perplexity interpolated linearly in the ratio along that run's fine sweep. Held-out text: the
paragraphs of ../shared's TinyStories dev file after the 567 embedded in the package (the training
text is the embedded calibration slice). Prints one JSON object per line.

    python benchmarks/bench_dsmoe.py [--variants full,no_ste] [--weights 1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np

import moeify
from moeify.calibration.data import read_text
from moeify.methods.dsmoe.analysis import tau_sweep
from moeify.options import parse_assignments

SHARED = Path(__file__).resolve().parents[2] / "shared" / "assets" / "data" / "tinystories"
EMBEDDED_PARAGRAPHS = 567
FINE_TAUS = tuple(sorted({round(0.05 * k, 2) for k in range(20)} | {round(0.5 + 0.01 * k, 2) for k in range(1, 10)}))


def held_out_file(folder: Path, paragraphs: int) -> Path:
    text = (SHARED / "tinystories_valid_dev.txt").read_text()
    path = folder / "tinystories_heldout.txt"
    path.write_text("\n\n".join(text.split("\n\n")[EMBEDDED_PARAGRAPHS:][:paragraphs]))
    return path


def run(options: dict[str, str], held_out: Path, seed: int) -> dict:
    result = moeify.convert(None, "dsmoe", options, eval=held_out, seed=seed, measure_speed=False)
    record = result.record
    training, analysis = record["details"]["training"], record["details"]["analysis"]
    fine = tau_sweep(result.model, result.tokenizer, [read_text(held_out)], record["metrics"]["eval"]["seq_len"],
                     FINE_TAUS)
    ratios = [row["mlp_ratio"] for row in analysis["tau_sweep"]]
    return {
        "variant": record["config"]["variant"], "sparsity_weight": record["config"]["sparsity_weight"],
        "config": record["config"], "convert_s": round(record["timings"]["convert_s"], 1),
        "s_per_step": round(record["timings"]["convert_s"] / training["steps"], 3),
        "first_lm": training["first_lm"], "last_lm": training["last_lm"], "last_sparsity": training["last_sparsity"],
        "dense_ppl": record["metrics"]["dense_ppl"], "ppl": record["metrics"]["ppl"],
        "mlp_ratio": record["active"]["mlp_ratio"], "apr": record["active"]["apr"],
        "experts_per_layer": analysis["activated_experts"]["per_file"],
        "table4": [{k: row[k] for k in ("tau", "ppl", "model_ratio", "apr", "mlp_ratio")}
                   for row in analysis["tau_sweep"]],
        "sweep_monotone": all(a >= b for a, b in zip(ratios, ratios[1:])),
        "fine_sweep": [{k: row[k] for k in ("tau", "ppl", "mlp_ratio")} for row in fine],
    }


def ppl_at_ratio(sweep: list[dict], ratio: float) -> float | None:
    """Perplexity at an activated MLP ratio, log-linear between the sweep's points; None outside them.
    (Several taus can give the same ratio; the best perplexity among them is kept.)"""
    best: dict[float, float] = {}
    for row in sweep:
        best[row["mlp_ratio"]] = min(best.get(row["mlp_ratio"], math.inf), math.log(row["ppl"]))
    xs = sorted(best)
    return None if not xs[0] <= ratio <= xs[-1] else float(math.exp(np.interp(ratio, xs, [best[x] for x in xs])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="full,no_ste")
    parser.add_argument("--weights", default="1", help="sparsity-loss weights")
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
    every = [r for results in runs.values() for r in results]
    for result in every:
        others = {f"{r['variant']}@{r['sparsity_weight']}": ppl_at_ratio(r["fine_sweep"], result["mlp_ratio"])
                  for r in every if r is not result}
        print(json.dumps({"matched": f"{result['variant']}@{result['sparsity_weight']}", "mlp_ratio": result["mlp_ratio"],
                          "ppl": result["ppl"], "others_at_ratio": others}), flush=True)


if __name__ == "__main__":
    main()
