"""Where a converted model's GPU forward spends its time against its dense model's: torch.profiler's CUDA
kernels of a few eager forwards at each shape, the kernels launched per forward, and the largest by time.

    python benchmarks/gpu_profile.py RUN_DIR [--shapes 8x256,1x1,32x1] [--top 12]

RUN_DIR is a ``moeify convert`` folder (its record.json names the dense model). A shape BxT runs B sequences
of T tokens without a KV cache: 1x1 and 32x1 stand for decoding steps at batch 1 and 32. Prints one table
per model and shape; meant for a GPU machine (gpu_lease.sh), runs on a CPU too (the operators' table alone).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import moeify

FORWARDS = 3  # profiled forwards per shape, after as many untimed ones


def profile(model: torch.nn.Module, batch: int, tokens: int, top: int) -> str:
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        for _ in range(FORWARDS):
            model(ids)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(FORWARDS):
                model(ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
    events = prof.key_averages()
    if device.type != "cuda":  # no kernels to count: the operators' table alone
        return events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launched = sum(e.count for e in kernels) / FORWARDS
    kernel_ms = sum(e.self_device_time_total for e in kernels) / FORWARDS / 1e3
    table = events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60)
    return f"{launched:.0f} kernels per forward, {kernel_ms:.2f} ms of kernel time per forward\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--shapes", default="8x256,1x1,32x1", help="BxT shapes, comma-separated")
    parser.add_argument("--top", type=int, default=12, help="rows of each table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dense_path = json.loads((args.run_dir / "record.json").read_text())["model"]
    for name, path in (("dense", dense_path), ("moe", args.run_dir)):
        model, _ = moeify.load_model(path, args.device, "bfloat16")
        model.eval()
        for batch, tokens in shapes:
            print(f"==== {name} {batch}x{tokens} ({path})\n{profile(model, batch, tokens, args.top)}", flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
