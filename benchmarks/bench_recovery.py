"""How to recover a conversion: the recovery's choices measured on SmolLM2-135M-Instruct (the GGUF in
../shared/assets), each a run of the same budget from the same converted model.

A conversion at APR 0.5 (``--method``, matched by the method's budget matcher, as ``moeify compare`` does)
is made once and kept in ``--models``; each variant (``VARIANTS``: learning rate, what trains, LoRA or the
weights, whole-vocabulary or top-k distillation, distillation or the LM loss) recovers a fresh copy of it
on WikiText-2 valid for ``--tokens`` tokens. The choice between variants is made on the next-token loss of
the last ``HELD_OUT_WINDOWS`` windows (one pass over the text: each window is unseen when its loss is taken,
so this is held-out text that never reaches the table's evaluation), the same quantity whatever the loss
trained; the perplexity on ``--eval-chars`` characters of WikiText-2 raw test from ``EVAL_START`` (apart
from the first 100,000 that ``bench_real.py`` and the compare table evaluate on) after each of
``--milestones`` is shown beside it. Rows are appended to
``--out`` as JSON lines as they finish and a rerun skips the rows already there, so a long sweep can be
continued; ``--markdown`` prints the table of what the file holds. The top-k variants share one teacher
cache (``--models``/teacher_cache), built by the first; the timings were taken with glibc's dynamic mmap
threshold (``MALLOC_MMAP_THRESHOLD_=4294967296``: the training loop's fixed 4 MiB one costs a third more time
per step here, for less resident memory; ``offload/allocator.py``).

    python benchmarks/bench_recovery.py --method cmoe --variants top64_lr1e-4,top64_lr3e-4 [--tokens 51200]
    python benchmarks/bench_recovery.py --markdown

The rows at the default loss (steps per token and the schedule) came from:

    python benchmarks/bench_recovery.py --method static_prune --variants mix_b4,mix_b1,mix_b1_linear,\
        mix_b1_lr6e-4_linear --tokens 200000 --milestones 50000,100000,200000 --eval-chars 50000
    python benchmarks/bench_recovery.py --method cmoe --variants mix_b4,mix_b1 --tokens 50000 --milestones 50000 \
        --eval-chars 50000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_real import CALIB, EVAL, MODEL, MODELS  # this folder is on sys.path when run

OUT = Path(__file__).resolve().parent / "results" / "bench_recovery.jsonl"
EVAL_SEQ_LEN = 2048
EVAL_START = 500_000  # the evaluation slice starts here: apart from bench_real's and compare's first 100,000
# the choice's criterion: the mean next-token loss of the last windows, each unseen when its loss is taken; the
# same windows whatever the batch size (the windows' order is seeded), over as many steps as they fill
HELD_OUT_WINDOWS = 24

# the loss, learning-rate and parts variants ran with four windows a step, the default then
B4 = {"recover_batch_size": 4}
# name -> recovery options beside the budget (``RecoveryOptions``' defaults where not given; every
# variant but the LM one distils)
VARIANTS: dict[str, dict[str, Any]] = {
    "top64_lr1e-4": {**B4, "recover_lm_share": 0.0, "recover_lr": 1e-4, "recover_top_k": 64},
    "top64_lr3e-4": {**B4, "recover_lm_share": 0.0, "recover_lr": 3e-4, "recover_top_k": 64},
    "top64_lr1e-3": {**B4, "recover_lm_share": 0.0, "recover_lr": 1e-3, "recover_top_k": 64},
    "full_lr3e-4": {**B4, "recover_lm_share": 0.0, "recover_lr": 3e-4},
    "top64_lora8_lr1e-3": {**B4, "recover_lm_share": 0.0, "recover_lr": 1e-3, "recover_top_k": 64,
                           "recover_lora_rank": 8},
    "top64_mlp_lr3e-4": {**B4, "recover_lm_share": 0.0, "recover_lr": 3e-4, "recover_top_k": 64,
                         "recover_parts": "routers,experts,shared,norms"},
    "lm_lr3e-4": {**B4, "recover_lr": 3e-4, "recover_lm_share": 1.0},
    # the default loss (half of each) at 200,000 tokens: steps per token and the schedule
    "mix_b4": {**B4, "recover_lr": 3e-4, "recover_recompute": False},
    "mix_b1": {"recover_lr": 3e-4, "recover_batch_size": 1, "recover_recompute": False},
    "mix_b4_linear": {**B4, "recover_lr": 3e-4, "recover_lr_schedule": "linear", "recover_recompute": False},
    "mix_b1_linear": {"recover_lr": 3e-4, "recover_batch_size": 1, "recover_lr_schedule": "linear",
                      "recover_recompute": False},
    "mix_b1_lr6e-4_linear": {"recover_lr": 6e-4, "recover_batch_size": 1, "recover_lr_schedule": "linear",
                             "recover_recompute": False},
}


def converted(method: str, apr: float, models: Path) -> Path:
    """The conversion of SmolLM2 by ``method`` at ``apr`` (made and saved once)."""
    import moeify
    from moeify.api import ConversionResult
    from moeify.arch import DecoderAdapter
    from moeify.calibration.data import read_text
    from moeify.loading import load_model
    from moeify.methods import ConversionContext, get_method
    from moeify.options import build_config

    folder = models / f"{method}_apr{apr}"
    if folder.is_dir():
        return folder
    spec = get_method(method)
    model, tokenizer = load_model(str(MODEL))
    options = spec.match_budget(apr, DecoderAdapter(model))[0][0]
    ctx = ConversionContext(model, tokenizer, read_text(CALIB), 0, torch.device("cpu"), progress=True)
    start = time.perf_counter()
    details = spec.run(ctx, build_config(spec.config_cls, options)).details
    record = {"method": method, "options": options, "convert_s": time.perf_counter() - start,
              "details_keys": sorted(details)}
    moeify.save(ConversionResult(ctx.model.eval(), tokenizer, record), folder)
    return folder


def run_variant(folder: Path, name: str, tokens: int, milestones: list[int], eval_file: Path) -> dict[str, Any]:
    """Recover the conversion in ``folder`` with variant ``name``; the row to write."""
    import moeify
    from moeify.api.evaluate import evaluate
    from moeify.calibration.data import read_text, token_stream
    from moeify.loading import load_model
    from moeify.options import build_config
    from moeify.training.recovery import recover
    from moeify.training.recovery_options import RecoveryOptions

    teacher, tokenizer = load_model(str(MODEL))
    student = moeify.load(folder)
    options = build_config(RecoveryOptions, {"recover_tokens": tokens, **VARIANTS[name]})
    source = read_text(CALIB)

    def ppl(_: int) -> dict[str, Any]:  # LoRA adapters, while they train, sit inside ``student``
        result = evaluate(student, tokenizer, [eval_file], seq_len=EVAL_SEQ_LEN)
        return {"ppl": result["ppl"][eval_file.name], "apr": result["active"]["apr"]}

    before = ppl(0)
    with tempfile.TemporaryDirectory() as work:
        _, summary = recover(student, teacher, token_stream(source, tokenizer), options, seed=0,
                             device=torch.device("cpu"), identity={"model": str(MODEL), "text": source.sha256},
                             work_dir=Path(work), cache_dir=folder.parent / "teacher_cache",
                             milestones=milestones, on_milestone=ppl)
    held_out = summary["lm"][-(HELD_OUT_WINDOWS // options.batch_size):]
    kept = ("curve", "seconds", "teacher", "trainable_params", "losses", "kl", "lm")
    return {"variant": name, "options": VARIANTS[name], "tokens": tokens, "before": before,
            **{key: summary[key] for key in kept},
            "held_out_lm": sum(held_out) / len(held_out), "last_loss": summary["losses"][-1]}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a table; rows of the first protocol (before the held-out loss was logged, evaluated on the
    first 20,000 characters) show their last step's loss on its unseen windows instead, and their eval file."""
    lines = ["| conversion | variant | tokens | held-out next-token loss | last step's loss | PPL before | PPL after "
             "each milestone | evaluated on | s | trainable |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        curve = " / ".join(f"{p['ppl']:.2f} ({p['tokens'] // 1000}k)" for p in r["curve"])
        held_out = f"{r['held_out_lm']:.4f}" if "held_out_lm" in r else "-"
        lines.append(f"| {r['conversion']} | {r['variant']} | {r['tokens']:,} | {held_out} | {r['last_loss']:.4f} | "
                     f"{r['before']['ppl']:.2f} | {curve} | {r['eval_file']} | {r['seconds']:.0f} | "
                     f"{r['trainable_params']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="cmoe")
    parser.add_argument("--apr", type=float, default=0.5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=51_200)
    parser.add_argument("--milestones", default="25600,51200")
    parser.add_argument("--eval-chars", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--models", type=Path, default=MODELS)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.is_file() else []
    if args.markdown:
        print(markdown(rows))
        return
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; variants: {', '.join(VARIANTS)}")
    folder = converted(args.method, args.apr, args.models)
    conversion = folder.name
    milestones = [int(m) for m in args.milestones.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        eval_file = Path(tmp) / f"wikitext2_raw_test_{EVAL_START}_{EVAL_START + args.eval_chars}.txt"
        eval_file.write_text(EVAL.read_text()[EVAL_START:EVAL_START + args.eval_chars])
        for name in names:
            if any(r["conversion"] == conversion and r["variant"] == name and r["tokens"] == args.tokens
                   for r in rows):
                print(f"{name}: already in {args.out}", file=sys.stderr)
                continue
            row = {"conversion": conversion, **run_variant(folder, name, args.tokens, milestones, eval_file),
                   "eval_file": eval_file.name}
            rows.append(row)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: row[k] for k in ("conversion", "variant", "curve")}), flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
