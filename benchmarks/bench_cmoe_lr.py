"""The learning rate and schedule of CMoE's CPU fine-tuning recipe, chosen on training text only.

SmolLM2-135M (the GGUF in ../shared/assets) is carved once (S2A2E16, WikiText-2 valid calibration); then,
for each learning rate, the carved model is fine-tuned for ``--steps`` steps of 4 x 512 tokens on one
pass over disjoint windows of WikiText-2 valid (the same windows for every rate), at a constant rate or
decaying linearly to 0 (``lr_schedule``). Every batch is new when its loss is computed, so the mean loss of
the last 6 steps is a held-out measure on the training distribution; the evaluation text is never read.
Appends one row per rate and schedule to ``results/bench_cmoe_lr.jsonl``.

    python benchmarks/bench_cmoe_lr.py [--steps 16] [--lrs 5.95e-5,3e-4,1e-3] [--schedules constant,linear]
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from bench_real import CALIB, MODEL
from results_file import append_row

from moeify.calibration.data import read_text
from moeify.loading import load_model
from moeify.methods import ConversionContext
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.methods.cmoe.finetune import finetune
from moeify.options import build_config

OUT = Path(__file__).resolve().parent / "results" / "bench_cmoe_lr.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lrs", default="5.95e-5,3e-4,1e-3")
    parser.add_argument("--schedules", default="constant")
    args = parser.parse_args()
    model, tokenizer = load_model(str(MODEL))
    ctx = ConversionContext(model, tokenizer, read_text(CALIB), 0, torch.device("cpu"), progress=False)
    convert(ctx, build_config(CmoeConfig, {"spec": "S2A2E16", "analysis": False}))
    carved = copy.deepcopy(ctx.model.state_dict())
    for lr in map(float, args.lrs.split(",")):
        for schedule in args.schedules.split(","):
            ctx.model.load_state_dict(carved)
            config = build_config(CmoeConfig, {"spec": "S2A2E16", "finetune_samples": 4 * args.steps,
                                               "finetune_seq_len": 512, "lr": lr, "lr_schedule": schedule})
            start = time.perf_counter()
            losses = finetune(ctx, config, 2048)[1]["losses"]
            append_row(OUT, {"lr": lr, "lr_schedule": schedule, "steps": args.steps, "first_loss": losses[0],
                             "last6_mean_loss": round(sum(losses[-6:]) / 6, 4),
                             "s_per_step": round((time.perf_counter() - start) / args.steps, 1)})


if __name__ == "__main__":
    main()
