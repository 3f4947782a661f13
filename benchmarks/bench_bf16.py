"""Every method converting SmolLM2-135M in bfloat16 against the same conversion in float32.

For each method (its defaults, training methods at a short CPU budget), one process converts the GGUF
model (dequantised to the working dtype) in float32 and another in bfloat16, each calibrated/trained on
WikiText-2 valid and scored on a prefix of WikiText-2 raw test (``--eval-chars``, 512-token windows),
through ``moeify convert --dtype``. Prints one JSON line per method with both perplexities and their
relative gap, appended to ``--out``; the issue's bound is 1 %.

    python benchmarks/bench_bf16.py [--methods cmoe,more,...] [--eval-chars 20000]
        [--out benchmarks/results/bench_bf16.jsonl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_real import CALIB, EVAL, MODEL  # this folder is on sys.path when run

# the training methods at a CPU budget (their defaults: hundreds of steps)
OPTIONS = {"tomoe": {"steps": 20, "checkpoint_every": 0}, "dsmoe": {"steps": 10, "checkpoint_every": 0},
           "dense2moe": {"steps": 10, "checkpoint_every": 0, "seq_len": 256}}
METHODS = "cmoe,more,static_prune,random_split,teal,tomoe,dsmoe,dense2moe"


def convert(method: str, dtype: str, eval_file: Path, out: Path) -> float:
    sets = [arg for key, value in OPTIONS.get(method, {}).items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "moeify", "convert", str(MODEL), "--method", method, "--dtype", dtype,
               *sets, "--calib", str(CALIB), "--eval", str(eval_file), "--seq-len", "512", "--no-speed",
               "--out", str(out)]
    child = subprocess.run(command, capture_output=True, text=True, check=False)
    if child.returncode:
        raise RuntimeError(f"{method} {dtype}: {child.stderr[-2000:]}")
    return json.loads((out / "record.json").read_text())["metrics"]["ppl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--eval-chars", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_bf16.jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        eval_file = Path(tmp) / f"wikitext2_raw_test_first{args.eval_chars}.txt"
        eval_file.write_text(EVAL.read_text()[:args.eval_chars])
        for method in args.methods.split(","):
            ppl = {dtype: convert(method, dtype, eval_file, Path(tmp) / f"{method}-{dtype}")
                   for dtype in ("float32", "bfloat16")}
            row = {"method": method, "options": OPTIONS.get(method, {}), "eval": eval_file.name, "ppl": ppl,
                   "relative_gap": round(abs(ppl["bfloat16"] / ppl["float32"] - 1), 4)}
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
