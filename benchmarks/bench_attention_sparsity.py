"""An MoE at APR 0.5 that spends its budget as TEAL does: CMoE over half of every MLP, and TEAL's input
thresholds on the attention projections at half, where an MoE at APR 0.5 keeps the attention whole and a
third of every MLP (SmolLM2: the attention holds a quarter of the decoder's parameters). Converted,
recovered with ``compare_recovery.py``'s budget and settings, and timed natively against the dense model.

Stages, each a folder under ``--work`` (a stage whose folder exists is not run again, so a run stopped
between stages continues):

- ``cmoe``: ``moeify convert MODEL --method cmoe --set spec=SPEC --set refit_down=true`` (``--spec``), bench_real's
  calibration and evaluation texts;
- ``hybrid``: its attention thresholded with TEAL's rule and helpers (``methods.teal.convert``: one magnitude
  quantile per input tensor, q/k/v sharing theirs) at ``--attention-sparsity``, on TEAL's calibration windows
  (8 of 2048 tokens of WikiText-2 valid); every layer measured in one pass of the unthresholded model, where
  TEAL calibrates a layer after the earlier ones are thresholded;
- ``recovered``: ``moeify recover hybrid --tokens N --milestones 50000,100000`` (``--tokens``) with the
  comparison's recovery settings (``compare_recovery.RECOVERY``), the perplexity after each budget on the way;
- ``bench.json``: ``moeify bench recovered`` with the comparison's quiet-CPU bench (``BENCH_ARGS``).

Then one row in ``--out``; ``--markdown`` prints its rows beside the comparison's CMoE with the refit (the
same conversion with the attention whole, a third of each MLP) and TEAL.

    python benchmarks/bench_attention_sparsity.py [--spec S2A2E8] [--attention-sparsity 0.5] [--work DIR]
    python benchmarks/bench_attention_sparsity.py --markdown
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_real import CALIB, MODEL, write_eval_prefix  # this folder is on sys.path when run
from compare_recovery import BENCH_ARGS, BUDGETS, DEFAULT_RUN, EVAL_CHARS, RECOVERY, RUNS, rows_of, speed_cell
from results_file import append_row, git_commit, read_rows

OUT = Path(__file__).resolve().parent / "results" / "bench_attention_sparsity.jsonl"


def moeify_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "moeify", *args], check=True)


def threshold_attention(source: Path, out: Path, sparsity: float) -> None:
    """``source`` with its attention projections' inputs thresholded at ``sparsity`` (TEAL's rule), saved to
    ``out`` with ``source``'s record."""
    import torch

    import moeify
    from moeify.api import ConversionResult
    from moeify.arch import DecoderAdapter
    from moeify.calibration.data import calibration_batches, read_text
    from moeify.methods.teal import TealConfig
    from moeify.methods.teal.convert import magnitude_threshold, thresholded

    model, tokenizer = moeify.load_model(source)
    adapter = DecoderAdapter(model)
    attrs = dict(adapter.family.attn_projections)  # role -> the attention module's attribute
    # the input projections (q, k, v or a fused qkv) read one tensor, o another: one quantile each, as TEAL's
    seen: dict[tuple[int, bool], list[torch.Tensor]] = {}
    hooks = []
    for i in range(adapter.num_layers):
        for role, projection in adapter.attention_projections(i).items():
            if role in ("q", "qkv", "o"):
                store = seen.setdefault((i, role == "o"), [])
                hooks.append(projection.register_forward_pre_hook(lambda _, a, s=store: s.append(a[0].detach())))
    windows = calibration_batches(read_text(CALIB), tokenizer, *TealConfig().calibration_windows(model.config), 0)
    with torch.no_grad():
        for window in windows:
            model(window[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    for i in range(adapter.num_layers):
        thresholds = {output: magnitude_threshold(seen.pop((i, output)), sparsity) for output in (False, True)}
        for role, projection in adapter.attention_projections(i).items():
            setattr(adapter.attention_module(i), attrs[role],
                    thresholded(projection, sparsity, thresholds[role == "o"]))
    record = json.loads((source / "record.json").read_text())
    record["attention_sparsity"] = sparsity
    moeify.save(ConversionResult(model, tokenizer, record), out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The stages not yet in ``args.work``, then the row."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    eval_file = write_eval_prefix(EVAL_CHARS, work)
    texts = ("--calib", str(CALIB), "--eval", str(eval_file), "--seq-len", "2048")
    cmoe, hybrid, recovered, bench = work / "cmoe", work / "hybrid", work / "recovered", work / "bench.json"
    if not cmoe.is_dir():
        moeify_cli("convert", str(MODEL), "--method", "cmoe", "--set", f"spec={args.spec}", "--set", "refit_down=true",
                   *texts, "--no-speed", "--out", str(cmoe))
    if not hybrid.is_dir():
        threshold_attention(cmoe, hybrid, args.attention_sparsity)
    if not recovered.is_dir():
        sets = [arg for key, value in RECOVERY.items() for arg in ("--set", f"{key}={value}")]
        moeify_cli("recover", str(hybrid), "--tokens", str(args.tokens), "--milestones",
                   ",".join(str(t) for t in BUDGETS if t < args.tokens), *texts, *sets, "--no-speed",
                   "--out", str(recovered))
    if not bench.is_file():
        moeify_cli("bench", str(recovered), *BENCH_ARGS, "--json", str(bench))
    record = json.loads((recovered / "record.json").read_text())
    timed = json.loads(bench.read_text())
    return {"spec": args.spec, "attention_sparsity": args.attention_sparsity, "commit": git_commit(),
            "dense_ppl": record["metrics"]["dense_ppl"], "ppl_before": record["pre_recovery"]["ppl"],
            "apr_before": record["pre_recovery"]["active"]["apr"], "apr": record["active"]["apr"],
            "mlp_ratio": record["active"]["mlp_ratio"],
            "curve": [[p["tokens"], p["ppl"]] for p in record["recovery"]["curve"]]
            + [[record["recovery"]["tokens"], record["metrics"]["ppl"]]],
            "convert_s": record["timings"]["convert_s"], "recover_s": record["recovery"]["wall_s"],
            "bench": {"prefill": {f"{p['batch_size']}x{p['seq_len']}": p["speedup"] for p in timed["prefill"]},
                      "decode": {f"b{d['batch_size']}": d["speedup"] for d in timed["decode"]},
                      "ideal": timed["ideal_speedup"]}}


def markdown(path: Path) -> str:
    """This file's rows beside the comparison's CMoE with the refit and TEAL (its table's protocol)."""
    half = "half of each input zeroed"
    lines = ["| model | APR | MLP | attention | PPL before | after 50k | after 100k | after 200k | native speed-up "
             "(8 x 256) |", "|---|---|---|---|---|---|---|---|---|"]
    for run_name, method in (("refit", "cmoe"), (DEFAULT_RUN, "teal")):
        row = next(r for r in rows_of(RUNS[run_name]) if r["method"] == method and "curve" in r)
        mlp, attention = (half, half) if method == "teal" else (f"CMoE {row['options']['spec']}, refit", "whole")
        after = " | ".join(f"{ppl:.2f}" for _, ppl in row["curve"][1:])
        lines.append(f"| {method} (compare_recovery) | {row['apr']:.3f} | {mlp} | {attention} | "
                     f"{row['ppl_before']:.2f} | {after} | {speed_cell(RUNS[run_name], row)} |")
    for r in read_rows(path):
        after = " | ".join(f"{ppl:.2f}" for _, ppl in r["curve"])
        lines.append(f"| cmoe, attention thresholded | {r['apr']:.3f} | CMoE {r['spec']}, refit | "
                     f"{r['attention_sparsity']:.0%} of each input zeroed | {r['ppl_before']:.2f} | {after} | "
                     f"{r['bench']['prefill']['8x256']:.2f}x (moeify bench) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="S2A2E8", help="CMoE's spec (S2A2E8: half of each MLP)")
    parser.add_argument("--attention-sparsity", type=float, default=0.5,
                        help="share of the attention projections' inputs zeroed (TEAL's sparsity)")
    parser.add_argument("--tokens", type=int, default=max(BUDGETS), help="recovery tokens")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-attention-sparsity"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    append_row(args.out, run(args))


if __name__ == "__main__":
    main()
