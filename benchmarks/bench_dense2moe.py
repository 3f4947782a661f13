"""Dense2MoE on stories260K with one pruned layer and the default fine-tuning budget: ``lfuc`` against
Table 5's baseline ``prune_upcycle`` and ShortGPT-style ``prune_only``, on held-out TinyStories text.

Every run converts the embedded stories260K with the method's defaults (same removed layer, same
fine-tuning budget and data: the embedded calibration slice) and evaluates on the paragraphs of
../shared's TinyStories dev file after the 567 embedded in the package. ``prune_only`` has no router, so
it runs once per seed; the MoE variants run once per top-k. Prints one JSON object per run, then one
summary per (seed, top-k): whether lfuc has the lowest perplexity.

    python benchmarks/bench_dense2moe.py [--top-k 1,2] [--seeds 0,1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_dsmoe import held_out_file  # the same held-out slice (this folder is on sys.path when run)

import moeify
from moeify.options import parse_assignments


def run(options: dict[str, str], held_out: Path, seed: int) -> dict:
    record = moeify.convert(None, "dense2moe", options, eval=held_out, seed=seed, measure_speed=False).record
    details, active = record["details"], record["active"]
    return {"variant": record["config"]["variant"], "top_k": record["config"]["top_k"], "seed": seed,
            "ppl": record["metrics"]["ppl"], "dense_ppl": record["metrics"]["dense_ppl"],
            "active_params": active["active_params"], "total_params": active["total_params"], "apr": active["apr"],
            "selection": details["selection"], "expert_sources": details["expert_sources"],
            "first_loss": details["finetune"]["first_loss"], "last_loss": details["finetune"]["last_loss"],
            "load": [entry["load"] for entry in record["routing"]], "convert_s": round(record["timings"]["convert_s"], 1),
            "config": record["config"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-k", default="1,2", help="top-k values of the MoE variants (default 1,2)")
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated (default 0)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dense2moe option")
    args = parser.parse_args()
    base = parse_assignments(args.set)
    with tempfile.TemporaryDirectory() as folder:
        held_out = held_out_file(Path(folder), 600)
        for seed in (int(s) for s in args.seeds.split(",")):
            only = run({**base, "variant": "prune_only"}, held_out, seed)
            print(json.dumps(only), flush=True)
            for top_k in args.top_k.split(","):
                rows = [run({**base, "variant": v, "top_k": top_k}, held_out, seed) for v in ("lfuc", "prune_upcycle")]
                for row in rows:
                    print(json.dumps(row), flush=True)
                ppl = {row["variant"]: row["ppl"] for row in [*rows, only]}
                print(json.dumps({"summary": True, "seed": seed, "top_k": int(top_k), "ppl": ppl,
                                  "lfuc_lowest": ppl["lfuc"] < min(ppl["prune_upcycle"], ppl["prune_only"])}),
                      flush=True)


if __name__ == "__main__":
    main()
