"""Peak memory and time of training steps of every training method on a real model (SmolLM2-135M by
default), beside ``moeify plan``'s estimate of the training phase for the same options (weights,
gradients and AdamW moments of what is trained, activations, logits chunks, the process).

Each (method, shape) runs in a fresh process: the model is loaded and prepared for training (CMoE carved
on 2 calibration windows, DSMoE partitioned, Dense2MoE's layers fused, ToMoE's masks in place), the
kernel's peak-RSS counter is reset (``/proc/self/clear_refs``; the RSS then is reported as "at start":
the prepared model and what loading left allocated), ``--steps`` optimizer steps run through the
method's own training code, and the peak RSS (``VmHWM``) and seconds per step are read. Shapes are
micro-batches: ``4x512`` is one micro-batch of 4 x 512 tokens; ``1x2048`` is the paper's sequence length,
a step of batch 2 accumulated over two micro-batches of 1 x 2048. Training text: WikiText-2 valid.
Prints one JSON object per line, then a markdown table.

    python benchmarks/bench_train_memory.py [--model PATH] [--methods cmoe,tomoe,dsmoe,dense2moe]
        [--shapes 4x512,1x2048] [--steps 2] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from moeify.memory_plan import method_plan
from moeify.methods import get_method
from moeify.planning import ModelShape

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
SMOLLM2 = ASSETS / "models" / "smollm2-135m-instruct"
TRAIN_TEXT = ASSETS / "data" / "wikitext2" / "valid.txt"
METHODS = ("cmoe", "tomoe", "dsmoe", "dense2moe")
GIB = 2 ** 30


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field in GiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GIB
    raise KeyError(field)


_AT_START: list[float] = []  # VmRSS when training starts (the prepared model, what loading left behind)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    _AT_START.append(_status("VmRSS"))


def _options(method: str, batch: int, seq_len: int, accum: int, steps: int) -> dict[str, Any]:
    """The method's training options for this shape; its other options stay at their defaults."""
    if method == "cmoe":
        return {"spec": "S2A2E16", "calib_samples": 2, "seq_len": seq_len, "finetune_steps": steps,
                "finetune_batch_size": batch * accum, "grad_accum": accum}
    common = {"steps": steps, "batch_size": batch * accum, "grad_accum": accum, "seq_len": seq_len}
    if method == "dense2moe":
        return {**common, "warmup": 0, "calib_samples": 2}
    return common


def _prepare_and_train(method: str, ctx: Any, config: Any) -> dict[str, Any]:
    """Prepare the model for training (not measured), then run the training (measured); returns the
    training log summary. Each method's training entry point is called as its conversion calls it."""
    seq_len = config.effective_seq_len(ctx.model.config)
    if method == "cmoe":
        from moeify.methods.cmoe.convert import convert
        from moeify.methods.cmoe.finetune import finetune

        convert(ctx, dataclasses.replace(config, finetune_steps=0))
        _reset_peak()
        return finetune(ctx, config, seq_len)[1]
    if method == "dsmoe":
        from moeify.methods.dsmoe.convert import partition_model_
        from moeify.methods.dsmoe.train import continue_training

        partition_model_(ctx, config)
        _reset_peak()
        return continue_training(ctx, config, seq_len)
    if method == "dense2moe":
        from moeify.methods.dense2moe.convert import convert
        from moeify.methods.dense2moe.train import finetune

        convert(ctx, dataclasses.replace(config, steps=0, warmup=0))
        _reset_peak()
        return finetune(ctx, config, seq_len)
    from moeify.methods.tomoe.convert import resolve_attention
    from moeify.methods.tomoe.train import learned_masks

    _reset_peak()
    with learned_masks(ctx, resolve_attention(ctx, config)[0], seq_len) as (_theta, _masked, log):
        return log


def planned(method: str, shape: ModelShape, config: Any) -> tuple[dict[str, float], float]:
    """``moeify plan``'s estimate of this run's training phase (GiB by part, the process's share included;
    the model loaded from GGUF, dequantised to float32: nothing memory-mapped), and the activations it
    would count without recomputation."""
    def train_phase(cfg: Any) -> tuple[dict[str, int], int]:
        plan = method_plan(shape, get_method(method), cfg, torch.float32, shape.context, "cpu", gguf=True)
        return plan.phases["train"], plan.process

    parts, process = train_phase(config)
    without_recompute, _ = train_phase(dataclasses.replace(config, recompute=False))
    return {"process": process / GIB, **{name: value / GIB for name, value in parts.items()}}, \
        without_recompute["activations"] / GIB


def alternatives(row: dict[str, Any]) -> dict[str, float]:
    """What the estimate becomes (GiB) with the memory savers moeify does not apply: bf16 weights and
    gradients (half of their float32 bytes), 8-bit AdamW moments (a quarter), and without recomputation."""
    parts, base = row["estimate_parts_gib"], row["estimate_gib"]
    return {"as run": base,
            "bf16 weights+grads": base - (parts["weights"] + parts["gradients"]) / 2,
            "8-bit AdamW states": base - parts["optimizer"] * 3 / 4,
            "no recompute": base - parts["activations"] + row["activations_without_recompute_gib"]}


def child(args: argparse.Namespace) -> None:
    from moeify.calibration.data import read_text
    from moeify.loading import load_model
    from moeify.methods import ConversionContext
    from moeify.options import build_config, parse_assignments

    batch, seq_len = map(int, args.shape.split("x"))
    accum = 2 if seq_len >= 2048 else 1
    process = _status("VmRSS")
    model, tokenizer = load_model(args.model)
    shape = ModelShape.from_config(model.config, Path(args.model).name)  # before preparation changes the model
    ctx = ConversionContext(model, tokenizer, read_text(args.text), 0, torch.device("cpu"), progress=False)
    options = {**_options(args.method, batch, seq_len, accum, args.steps), **parse_assignments(args.set)}
    config = build_config(get_method(args.method).config_cls, options)
    log = _prepare_and_train(args.method, ctx, config)
    peak = _status("VmHWM")
    steps, trainable = len(log["losses"]), log["trainable_params"]
    parts, without_recompute = planned(args.method, shape, config)
    row = {"method": args.method, "shape": args.shape, "micro_batches": accum, "steps": steps,
           "peak_rss_gib": round(peak, 3), "estimate_gib": round(sum(parts.values()), 3),
           "rss_at_start_gib": round(_AT_START[-1], 3), "process_rss_gib": round(process, 3),
           "estimate_parts_gib": {k: round(v, 3) for k, v in parts.items()},
           "activations_without_recompute_gib": round(without_recompute, 3),
           "trainable_params": trainable, "recompute": config.recompute,
           "s_per_step": round(log["seconds"] / steps, 2), "losses": log["losses"]}
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--text", default=str(TRAIN_TEXT))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--shapes", default="4x512,1x2048")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra options, every method")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for method in args.methods.split(","):
        for shape in args.shapes.split(","):
            command = [sys.executable, __file__, "--child", "--method", method, "--shape", shape, "--model", args.model,
                       "--text", args.text, "--steps", str(args.steps), *(f"--set={s}" for s in args.set)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(json.dumps({"method": method, "shape": shape, "error": done.stderr.strip().splitlines()[-1]}))
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| method | micro-batch | peak RSS GiB | estimate GiB | RSS at start GiB | s / step | trainable params |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        accum = f" (x{r['micro_batches']} accumulated)" if r["micro_batches"] > 1 else ""
        print(f"| {r['method']} | {r['shape']}{accum} | {r['peak_rss_gib']:.2f} | {r['estimate_gib']:.2f} | "
              f"{r['rss_at_start_gib']:.2f} | {r['s_per_step']:.1f} | {r['trainable_params']:,} |")
    names = list(alternatives(rows[0])) if rows else []
    print("\nEstimated peak (GiB) with the savers moeify does not apply, and without its recomputation:\n")
    print("| method | micro-batch | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['method']} | {r['shape']} | " + " | ".join(f"{v:.2f}" for v in alternatives(r).values()) + " |")


if __name__ == "__main__":
    main()
