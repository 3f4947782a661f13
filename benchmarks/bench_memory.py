"""Peak memory of conversions of a ~1.1B-parameter model against ``moeify plan``'s estimate.

The model is LLaMA-shaped (hidden 2048, MLP 5632, 22 layers, 32 query / 4 key-value heads, vocabulary
32,000: TinyLlama's shape), randomly initialised from a fixed seed and saved in bfloat16 (~2.2 GB) with
the embedded tokenizer (its 512 ids are a subset of the vocabulary), once, into ``--model-dir``. Each
method then converts it in its own process (``python -m moeify convert``, small calibration, a short
held-out text, no speed pass), whose peak resident memory (``ru_maxrss``) is read when it exits and
printed beside ``moeify plan``'s estimate for the same options, as one JSON line per method.

    python benchmarks/bench_memory.py [--model-dir /tmp/moeify-llama-1.1b] [--methods cmoe,more,static_prune]
        [--out benchmarks/results/bench_memory.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moeify.api.plan import plan
from moeify.calibration.data import EMBEDDED_EVAL, read_text
from moeify.loading import load_model
from moeify.planning import GIB

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
OPTIONS = {"calib_samples": "4", "seq_len": "128"}
EVAL_SEQ_LEN = 256
EVAL_CHARS = 12_000  # about 3,000 tokens: at least one full batch of 8 windows of 256


def build(folder: Path) -> None:
    """The random bfloat16 model and the embedded tokenizer, saved into ``folder`` (skipped if there)."""
    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(folder)
    load_model(None)[1].save_pretrained(folder)


def measure(model_dir: Path, method: str, eval_file: Path, out: Path) -> dict:
    options = [arg for key, value in OPTIONS.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "moeify", "convert", str(model_dir), "--method", method, *options,
               "--eval", str(eval_file), "--seq-len", str(EVAL_SEQ_LEN), "--no-speed", "--out", str(out)]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{method}: conversion failed: {child.stderr.read()[-2000:]}")
    estimate = plan(model_dir, method, OPTIONS, eval_seq_len=EVAL_SEQ_LEN)
    peak = usage.ru_maxrss * 1024
    return {"method": method, "options": OPTIONS, "peak_rss_gib": round(peak / GIB, 2),
            "plan_gib": round(estimate.peak / GIB, 2), "plan_phase": estimate.peak_phase,
            "plan_over_measured": round(estimate.peak / peak, 3), "seconds": round(seconds, 1),
            "checkpoint_gib": round(sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / GIB, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "moeify-llama-1.1b")
    parser.add_argument("--methods", default="cmoe,more,static_prune")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_memory.jsonl")
    args = parser.parse_args()
    build(args.model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        eval_file = Path(tmp) / "eval.txt"
        eval_file.write_text(read_text(EMBEDDED_EVAL).text[:EVAL_CHARS])
        for method in args.methods.split(","):
            row = measure(args.model_dir, method, eval_file, Path(tmp) / method)
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
