"""Sharded (``--fsdp``) against replicated data-parallel training on a real model: the same weights, and
what each process holds.

Converts SmolLM2-135M (default) with a training method three times, on the same global batch and seed:
in one process, in ``--processes`` processes under torchrun with every process holding the whole model
(replicated), and with the decoder layers' weights, gradients and AdamW state sharded among them (what
``moeify convert --fsdp`` does). Each run is this script in worker mode in processes of its own, calling
``moeify.convert`` without a work folder: no checkpoints, whose writing gathers the whole training state
to the main process's CPU (on this CPU-only machine that is the same memory the sharding saves; on GPUs
it is not). The table has the main process's peak resident memory over the whole conversion beside
``moeify plan``'s estimate for that run, the training's seconds, the perplexity, and the largest weight
difference from the replicated run and from the one-process run. Training text: the embedded calibration
slice; evaluation: the embedded held-out slice in windows of 256 tokens (the same for every run: only the
differences matter here; short windows keep the evaluation below the training's memory).

    python benchmarks/bench_fsdp.py [--model PATH] [--method dense2moe] [--processes 2] [--set KEY=VALUE ...]
        [--out benchmarks/results/bench_fsdp.json]
    python benchmarks/bench_fsdp.py --markdown    # the table of --out
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
SMOLLM2 = ASSETS / "models" / "smollm2-135m-instruct"
EVAL_SEQ_LEN = 256
OPTIONS = {"dsmoe": ["steps=4", "batch_size=4", "seq_len=256", "analyses=false"],
           "dense2moe": ["steps=4", "warmup=1", "batch_size=4", "seq_len=256"]}
TRAINING_LOG = {"dsmoe": "training", "dense2moe": "finetune"}  # where the record's details keep the log


def worker(model: str, method: str, options: list[str], out: Path, fsdp: bool) -> None:
    """One conversion in this process (all of them under torchrun); the main one saves it and its record."""
    import moeify
    from moeify.options import parse_assignments
    from moeify.training.distributed import init_from_env, is_main

    init_from_env("cpu", fsdp=fsdp)
    result = moeify.convert(model, method, parse_assignments(options), eval_seq_len=EVAL_SEQ_LEN,
                            measure_speed=False, progress=False, work_dir=None)
    if is_main():
        moeify.save(result, out)


def run(model: str, method: str, options: list[str], out: Path, processes: int, fsdp: bool) -> dict:
    launcher = [sys.executable] if processes == 1 else [shutil.which("torchrun") or "torchrun",
                                                        "--nproc_per_node", str(processes)]
    sets = [arg for option in options for arg in ("--set", option)]
    command = [*launcher, __file__, "--worker", str(out), "--model", model, "--method", method, *sets,
               *(["--fsdp"] if fsdp else [])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "record.json").read_text())


def gap(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--method", default="dense2moe", choices=sorted(OPTIONS))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra method option")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_fsdp.json"))
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.out.read_text())))
        return
    if args.worker is not None:
        worker(args.model, args.method, args.set, args.worker, args.fsdp)
        return
    options = OPTIONS[args.method] + args.set
    runs = (("one process", 1, False), (f"{args.processes} processes, replicated", args.processes, False),
            (f"{args.processes} processes, --fsdp", args.processes, True))
    from safetensors.torch import load_file

    rows, weights = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, fsdp in runs:
            folder = Path(tmp) / name.replace(" ", "_").replace(",", "")
            record = run(args.model, args.method, options, folder, processes, fsdp)
            weights[name] = load_file(folder / "model.safetensors")
            rows.append({"run": name, "peak_rss_gib": record["memory"]["peak_rss_gib"],
                         "plan_gib": record["memory"]["plan_gib"], "plan_phase": record["memory"]["plan_phase"],
                         "train_s": record["details"][TRAINING_LOG[args.method]]["seconds"],
                         "ppl": record["metrics"]["ppl"],
                         "gap_to_replicated": gap(weights[name], weights.get(runs[1][0], weights[name])),
                         "gap_to_one_process": gap(weights[name], weights["one process"])})
            print(json.dumps(rows[-1]), flush=True)
    rows[0]["gap_to_replicated"] = gap(weights[runs[0][0]], weights[runs[1][0]])
    result = {"method": args.method, "model": args.model, "options": options, "rows": rows}
    print(f"\n{args.method} on {Path(args.model).name}, {' '.join(options)}:\n")
    print(markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def _gap(value: float) -> str:
    return f"{value:.1e}" if value else "0"


def markdown(result: dict) -> str:
    """The table of a run's ``result`` (what ``--out`` holds)."""
    lines = [("| run | peak RSS, main process (GiB) | `moeify plan` (GiB, phase) | training s | perplexity | "
              "max weight difference to replicated / to one process |"), "|---|---|---|---|---|---|"]
    lines += [f"| {row['run']} | {row['peak_rss_gib']:.2f} | {row['plan_gib']:.2f} ({row['plan_phase']}) | "
              f"{row['train_s']:.1f} | {row['ppl']:.3f} | {_gap(row['gap_to_replicated'])} / "
              f"{_gap(row['gap_to_one_process'])} |" for row in result["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
