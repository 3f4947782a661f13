"""Peak memory of conversions against ``moeify plan``'s estimate: a ~1.1B-parameter model, or SmolLM2-135M.

The model is LLaMA-shaped (hidden 2048, MLP 5632, 22 layers, 32 query / 4 key-value heads, vocabulary
32,000: TinyLlama's shape), randomly initialised from a fixed seed and saved in bfloat16 (~2.2 GB) with
the embedded tokenizer (its 512 ids are a subset of the vocabulary), once, into ``--model-dir``. Each
method then converts it in its own process (``python -m moeify convert``, small calibration, a short
held-out text, no speed pass), whose peak resident memory (``VmHWM``) it reports when it exits, is
printed beside the ``moeify plan`` estimate the conversion made for itself (its record's ``memory``), as one
JSON line per method. ``--layer-by-layer`` converts with the model held one decoder layer at a time
(``moeify convert --layer-by-layer``), and checks that the saved folder loads and gives the logits of the
same conversion made with the model whole in memory (``matches_whole``; that one runs in this process).

    python benchmarks/bench_memory.py [--model-dir /tmp/moeify-llama-1.1b] [--methods cmoe,more,static_prune]
        [--layer-by-layer] [--out benchmarks/results/bench_memory.jsonl]
    python benchmarks/bench_memory.py --markdown [--layer-by-layer]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeify.methods import METHODS
from moeify.planning import GIB

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
OPTIONS = {"calib_samples": "4", "seq_len": "128"}
EVAL_SEQ_LEN = 256
EVAL_CHARS = 12_000  # about 3,000 tokens: at least one full batch of 8 windows of 256
SMOLLM2_STEPS = {"tomoe": {"steps": "5"}, "dsmoe": {"steps": "5"}, "dense2moe": {"steps": "10"}}  # dense2moe: its warm-up


def build(folder: Path) -> None:
    """The random bfloat16 model and the embedded tokenizer, saved into ``folder`` (skipped if there)."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from moeify.loading import load_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(folder)
    load_model(None)[1].save_pretrained(folder)


# The conversion's own process reports its peak: the kernel's high-water mark of its memory since it started
# (VmHWM). ``wait4``'s ru_maxrss would not do: a child forked from this process starts with this process's
# resident pages counted, and this process grows when it builds the model or compares with a whole one.
CHILD = """import runpy, sys
sys.argv = ["moeify", *sys.argv[1:]]
try:
    runpy.run_module("moeify", run_name="__main__")
finally:
    status = open("/proc/self/status").read()
    print("VmHWM", status.split("VmHWM:")[1].split()[0], file=sys.stderr)
"""


def measure(model: Path, method: str, options: dict[str, str], eval_file: Path, out: Path,
            layer_by_layer: bool, calib: Path | None = None) -> dict:
    sets = [arg for key, value in options.items() for arg in ("--set", f"{key}={value}")]
    sets += ["--calib", str(calib)] if calib else []
    command = [sys.executable, "-c", CHILD, "convert", str(model), "--method", method, *sets,
               "--eval", str(eval_file), "--seq-len", str(EVAL_SEQ_LEN), "--no-speed", "--out", str(out)]
    command += ["--layer-by-layer"] if layer_by_layer else []
    start = time.perf_counter()
    child = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    seconds = time.perf_counter() - start
    if child.returncode:
        raise RuntimeError(f"{method}: conversion failed: {child.stderr[-2000:]}")
    peak = int(child.stderr.strip().splitlines()[-1].split()[1]) * 1024
    record = json.loads((out / "record.json").read_text())
    plan = record["memory"]["plan_gib"] * GIB
    files = [model] if model.is_file() else list(model.glob("*.safetensors"))
    return {"model": model.name, "method": method, "options": options, "layer_by_layer": layer_by_layer,
            "peak_rss_gib": round(peak / GIB, 2), "plan_gib": record["memory"]["plan_gib"],
            "plan_phase": record["memory"]["plan_phase"], "plan_over_measured": round(plan / peak, 3),
            "seconds": round(seconds, 1), "ppl": record["metrics"]["ppl"],
            "checkpoint_gib": round(sum(f.stat().st_size for f in files) / GIB, 2)}


def matches_whole(model: Path, method: str, options: dict[str, str], eval_file: Path, saved: Path) -> dict:
    """The same conversion made with the whole model in memory: its perplexity, and the largest logit
    difference between it and the saved layer-by-layer conversion, loaded (0.0: identical)."""
    import torch

    from moeify import convert, load

    whole = convert(model, method, options, eval=eval_file, eval_seq_len=EVAL_SEQ_LEN, measure_speed=False,
                    check_memory=False)
    loaded = load(saved)
    ids = torch.arange(2, 130)[None]
    with torch.no_grad():
        difference = float((whole.model(ids).logits.float() - loaded(ids).logits.float()).abs().max())
    return {"whole_model_ppl": whole.record["metrics"]["ppl"], "max_logit_difference_to_whole": difference}


def markdown(results: Path) -> str:
    """One table per model of the latest row per method (and layer-by-layer or not): peak, plan and their ratio."""
    latest: dict[tuple[str, str, bool], dict] = {}
    for line in results.read_text().splitlines():
        row = json.loads(line)
        latest[row.get("model", "moeify-llama-1.1b"), row["method"], bool(row.get("layer_by_layer"))] = row
    models = list(dict.fromkeys(model for model, _, _ in latest))
    out = []
    for model in models:
        out += [f"{model}:", "", "| method | held | peak RSS GiB | plan GiB (phase) | plan / measured |",
                "|---|---|---|---|---|"]
        out += [f"| {method} | {'layer by layer' if layered else 'whole'} | {row['peak_rss_gib']:.2f} | "
                f"{row['plan_gib']:.2f} ({row['plan_phase']}) | {row['plan_over_measured']:.2f} |"
                for (name, method, layered), row in latest.items() if name == model]
        out.append("")
    return "\n".join(out)


def markdown_layer_by_layer(results: Path) -> str:
    """The latest layer-by-layer conversion per method of the 1.1B model that was compared with the whole-model
    conversion (``matches_whole``): peak, plan, perplexity beside the whole model's, largest logit difference."""
    latest: dict[str, dict] = {}
    for line in results.read_text().splitlines():
        row = json.loads(line)
        if row.get("layer_by_layer") and "whole_model_ppl" in row:
            latest[row["method"]] = row
    out = [("| method | peak RSS GiB | plan GiB (phase) | plan / measured | perplexity | whole model in memory | "
            "max logit difference |"), "|---|---|---|---|---|---|---|"]
    out += [f"| {method} | {row['peak_rss_gib']:.2f} | {row['plan_gib']:.2f} ({row['plan_phase']}) | "
            f"{row['plan_over_measured']:.2f} | {row['ppl']:.1f} | {row['whole_model_ppl']:.1f} | "
            f"{row['max_logit_difference_to_whole']:g} |" for method, row in latest.items()]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "moeify-llama-1.1b")
    parser.add_argument("--methods", help="comma-separated (default: cmoe,more,static_prune; with --smollm2 all)")
    parser.add_argument("--smollm2", action="store_true",
                        help="convert SmolLM2-135M (../shared/assets) at each method's default options")
    parser.add_argument("--layer-by-layer", action="store_true",
                        help="hold the model one decoder layer at a time, and compare with a whole-model conversion")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_memory.jsonl")
    parser.add_argument("--markdown", action="store_true", help="print the tables of the results file and exit "
                        "(with --layer-by-layer: the table of the layer-by-layer conversions against the whole model)")
    args = parser.parse_args()
    if args.markdown:
        print(markdown_layer_by_layer(args.out) if args.layer_by_layer else markdown(args.out))
        return
    if args.smollm2:
        from bench_real import CALIB as calib
        from bench_real import MODEL as model

        methods = args.methods or ",".join(m.name for m in METHODS)
    else:
        model, methods, calib = args.model_dir, args.methods or "cmoe,more,static_prune", None
        build(model)
    from moeify.calibration.data import EMBEDDED_EVAL, read_text

    with tempfile.TemporaryDirectory() as tmp:
        eval_file = Path(tmp) / "eval.txt"
        eval_file.write_text(read_text(EMBEDDED_EVAL).text[:EVAL_CHARS])
        for method in methods.split(","):
            options = SMOLLM2_STEPS.get(method, {}) if args.smollm2 else OPTIONS
            row = measure(model, method, options, eval_file, Path(tmp) / method, args.layer_by_layer, calib)
            if args.layer_by_layer:
                row.update(matches_whole(model, method, options, eval_file, Path(tmp) / method))
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
