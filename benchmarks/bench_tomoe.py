"""ToMoE on stories260K against static structured pruning at the same activated-parameter ratios, on
held-out TinyStories text.

For every requested ratio p: ToMoE with its defaults (and any ``--set`` options), then ``static_prune``
at ``active_ratio = p`` with and without attention head-dimension pruning. Training and calibration use
the embedded calibration slice; evaluation uses the paragraphs of ../shared's TinyStories dev file after
the 567 embedded in the package. Prints one JSON object per run, then one summary per ratio.

    python benchmarks/bench_tomoe.py [--ratios 0.5,0.7] [--seeds 0] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_dsmoe import held_out_file  # the same held-out slice (this folder is on sys.path when run)

import moeify
from moeify.options import parse_assignments


def run(method: str, options: dict[str, str], held_out: Path, seed: int) -> dict:
    record = moeify.convert(None, method, options, eval=held_out, seed=seed, measure_speed=False).record
    row = {"method": method, "options": options, "seed": seed, "ppl": record["metrics"]["ppl"],
           "dense_ppl": record["metrics"]["dense_ppl"], "apr": record["active"]["apr"],
           "convert_s": round(record["timings"]["convert_s"], 1)}
    if method == "tomoe":
        details = record["details"]
        row["structure"] = [{k: layer.get(k) for k in ("expert_width", "qk_dims", "vo_top_k")}
                            for layer in details["layers"]]
        row["last_kd"] = details["training"]["last_kd"]
        row["mask_threshold"] = details["mask_threshold"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", default="0.5", help="activated-parameter ratios p, comma-separated (default 0.5)")
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="tomoe option")
    args = parser.parse_args()
    base = parse_assignments(args.set)
    with tempfile.TemporaryDirectory() as folder:
        held_out = held_out_file(Path(folder), 600)
        for seed in (int(s) for s in args.seeds.split(",")):
            for ratio in args.ratios.split(","):
                rows = [run("tomoe", {**base, "active_ratio": ratio}, held_out, seed)]
                rows += [run("static_prune", {"active_ratio": ratio, "attention": attention}, held_out, seed)
                         for attention in ("on", "off")]
                for row in rows:
                    print(json.dumps(row), flush=True)
                ppl = {f"{r['method']}:{r['options'].get('attention', 'on')}": r["ppl"] for r in rows}
                print(json.dumps({"summary": True, "seed": seed, "active_ratio": float(ratio), "ppl": ppl,
                                  "tomoe_lowest": rows[0]["ppl"] < min(r["ppl"] for r in rows[1:])}), flush=True)


if __name__ == "__main__":
    main()
