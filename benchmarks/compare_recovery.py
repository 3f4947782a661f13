"""Every method at APR 0.5 recovered with the same budget: one ``moeify compare`` run on SmolLM2-135M-Instruct
(the GGUF in ../shared/assets), its rows kept in ``benchmarks/results/compare_recovery.jsonl``.

The run: ``moeify compare MODEL --active 0.5 --recover-tokens 50000,100000,200000`` with the calibration and
recovery text WikiText-2 valid and the evaluation text bench_real's (the first 100,000 characters of
WikiText-2 raw test, 2048-token windows), the methods' own training at a CPU budget (``METHOD_OPTIONS``)
and the recovery at moeify's defaults (half distillation, half the LM loss) but for activation checkpointing
(``RECOVERY``). Each method's record gives its perplexity before the recovery and after each budget, its APR
measured on the evaluation tokens, the native speed-up of convert's speed pass and the recovery's time.
``--markdown`` prints the table of what the results file holds, each speed-up from a quiet ``moeify bench`` of
the row's folder where ``--bench`` wrote one (a speed pass inside a long run on this CPU is easily disturbed);
the curve of the rows is drawn into ``docs/assets/``.
``--methods`` runs part of the methods (the same command and settings, the others' rows kept): the run folders
do not outlive a working session on this machine, so a comparison longer than one is run a few methods at a time,
each row saying its moeify version. ``--run refit`` runs CMoE and static pruning with the least-squares output
refit (``refit_down=true``, not in the papers), the rest as the table's run, into its own results file; the
table's ``--markdown`` adds its finished rows, as it does those of ``--run attention``: CMoE with the refit and
TEAL's thresholds on the attention at half (``attention_sparsity=0.5``), its MLP matched to what they leave, and
of ``--run attention_lr``, ``attention_lr1e-4`` and ``attention_linear``: the same at the recovery's learning rate
1.5e-4 (chosen by ``bench_attention_split.py``), 1e-4, and falling linearly from 3e-4 to 0 over the largest budget
(``recover_lr_schedule=linear``: its earlier budgets are points of that run, not runs of their own); each such
row is named by the options its run adds to the table's.
``--run lm`` runs the same comparison with the LM loss alone (``recover_lm_share=1``), ``--run kd`` CMoE, ToMoE and
static pruning with distillation alone (``recover_lm_share=0``) and ``--run mix_b4`` CMoE and static pruning with
half of each, each into its own results file, with the settings the comparison of the losses ran with
(``LOSS_COMPARISON``); their ``--markdown`` sets each budget's perplexity of every loss side by side, and
``--transfer`` evaluates the dense model and the models of every loss on text and zero-shot tasks unlike the
training text (``TRANSFER_TEXTS``, ``TRANSFER_TASKS``).

    python benchmarks/compare_recovery.py [--run mix|refit|attention|...] [--out DIR] [--resume] [--methods a,b]
    python benchmarks/compare_recovery.py [--run ...] --collect [--out DIR]  # rows of a run going or stopped
    python benchmarks/compare_recovery.py [--run ...] --bench  # then, on a quiet CPU
    python benchmarks/compare_recovery.py [--run ...] --markdown
    python benchmarks/compare_recovery.py --transfer [--markdown]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench_real import ASSETS, CALIB, MODEL, write_eval_prefix  # this folder is on sys.path when run

from moeify.files import write_output_file

HERE = Path(__file__).resolve().parent
EVAL_CHARS = 100_000
# in the order the run converts and recovers them
METHODS = ("cmoe", "static_prune", "tomoe", "dsmoe", "more", "teal", "dense2moe", "random_split")
KD_METHODS = ("cmoe", "tomoe", "static_prune")  # also distilled alone, for the comparison of the losses
BUDGETS = (50_000, 100_000, 200_000)
ACTIVE, APR_TOLERANCE = 0.5, 0.02  # the matched APR, and how far a row's measured APR may be from it
# the methods' own training at a CPU budget (their defaults are GPU-sized; DSMoE's, 200 steps of 8 x 256 tokens,
# are this CPU's), DSMoE without its tau sweep (seven evaluations), and MoRE's budget at the measured APR: its
# matcher's nominal 0.5 (uniform routing) measures 0.558 on this model
METHOD_OPTIONS = {"tomoe.steps": "250", "dense2moe.steps": "30", "dense2moe.seq_len": "256",
                  "dsmoe.analyses": "false", "more.target_pr": "0.56"}
# activations kept for the backward pass: a 135M model at 4 x 512 tokens fits this machine without recomputing
RECOVERY = {"recover_recompute": "false"}
# a speed pass whose slowest timed pass is this far above its fastest (relative to the median) was disturbed
# (another job on the CPU): its speed-up is printed flagged, to be measured again with ``moeify bench``
NOISY_SPREAD = 0.5
NOT_RUN = "not run yet"  # a method of a run still going (or stopped, to be resumed)


@dataclass(frozen=True)
class Run:
    """One comparison: its methods, its options beside ``METHOD_OPTIONS`` and ``RECOVERY`` (``--set`` pairs; a
    method's own, ``METHOD.KEY``, passed where the run has that method), where its rows and curve (the
    docs' figure, for the table's run) go, and
    where a ``moeify bench`` of a row's folder on a quiet CPU is kept (``--bench``, file METHOD.json):
    where one exists, the table's speed-up is its 8 x 256 prefill, not the run's own speed pass."""

    methods: tuple[str, ...]
    sets: dict[str, str]
    results: Path
    curve: Path | None
    out: Path
    bench: Path


RESULTS, MODELS = HERE / "results", HERE / "results" / "models"
FIGURES = HERE.parent / "docs" / "assets"  # the curves are figures of docs/results.md
# the comparison of the losses ran with four windows a step and CMoE's (and the random split's) S5A6E32, the
# recovery's default and the budget matcher's choice then: kept, so that its rows run again as they ran
LOSS_COMPARISON = {"recover_batch_size": "4", "cmoe.spec": "S5A6E32", "random_split.spec": "S5A6E32"}
REFIT_METHODS = ("cmoe", "static_prune")  # the methods that take refit_down, also run with it
# CMoE with the refit and TEAL's thresholds on half the attention, its MLP matched to what they leave
ATTENTION = {"recover_lm_share": "0.5", "cmoe.refit_down": "true", "cmoe.attention_sparsity": "0.5"}
# each run's recovery loss is its share of the LM loss beside distillation (recover_lm_share); the table is the
# run at moeify's defaults, "refit" adds rows to it, the others compare the losses on a few methods
RUNS = {"mix": Run(METHODS, {"recover_lm_share": "0.5"}, RESULTS / "compare_recovery.jsonl",
                   FIGURES / "compare_recovery.png", MODELS / "compare_apr0.5_mix", RESULTS / "compare_recovery_bench"),
        "refit": Run(REFIT_METHODS, {"recover_lm_share": "0.5", **{f"{m}.refit_down": "true" for m in REFIT_METHODS}},
                     RESULTS / "compare_recovery_refit.jsonl", None, MODELS / "compare_apr0.5_refit",
                     RESULTS / "compare_recovery_refit_bench"),
        "attention": Run(("cmoe",), ATTENTION, RESULTS / "compare_recovery_attention.jsonl", None,
                         MODELS / "compare_apr0.5_attention", RESULTS / "compare_recovery_attention_bench"),
        "attention_lr": Run(("cmoe",), {**ATTENTION, "recover_lr": "0.00015"},
                            RESULTS / "compare_recovery_attention_lr.jsonl", None,
                            MODELS / "compare_apr0.5_attention_lr", RESULTS / "compare_recovery_attention_lr_bench"),
        "attention_lr1e-4": Run(("cmoe",), {**ATTENTION, "recover_lr": "0.0001"},
                                RESULTS / "compare_recovery_attention_lr1e-4.jsonl", None,
                                MODELS / "compare_apr0.5_attention_lr1e-4",
                                RESULTS / "compare_recovery_attention_lr1e-4_bench"),
        "attention_linear": Run(("cmoe",), {**ATTENTION, "recover_lr_schedule": "linear"},
                                RESULTS / "compare_recovery_attention_linear.jsonl", None,
                                MODELS / "compare_apr0.5_attention_linear",
                                RESULTS / "compare_recovery_attention_linear_bench"),
        "mix_b4": Run(("cmoe", "static_prune"), {"recover_lm_share": "0.5", **LOSS_COMPARISON},
                      RESULTS / "compare_recovery_mix_b4.jsonl", None, MODELS / "compare_apr0.5_mix_b4",
                      RESULTS / "compare_recovery_mix_b4_bench"),
        "lm": Run(METHODS, {"recover_lm_share": "1", **LOSS_COMPARISON}, RESULTS / "compare_recovery_lm.jsonl", None,
                  MODELS / "compare_apr0.5_lm", RESULTS / "compare_recovery_lm_bench"),
        "kd": Run(KD_METHODS, {"recover_lm_share": "0", **LOSS_COMPARISON}, RESULTS / "compare_recovery_kd.jsonl",
                  None, MODELS / "compare_apr0.5", RESULTS / "compare_recovery_kd_bench")}
DEFAULT_RUN = "mix"
# runs whose finished rows join the table's
TABLE_RUNS = ("refit", "attention", "attention_lr", "attention_lr1e-4", "attention_linear")
LOSSES = ("mix_b4", "lm", "kd")  # the runs set side by side by ``--run kd --markdown`` and ``--transfer``
LOSS_NAMES = {"lm": "LM loss", "kd": "distillation", "mix": "half of each", "mix_b4": "half of each"}
# ``--bench``: each finished row's folder against the dense model, on a quiet CPU
BENCH_ARGS = ("--prefill", "1x256,8x256", "--decode", "8", "--new-tokens", "16", "--repeats", "5")


def set_args(options: dict[str, str]) -> list[str]:
    """``options`` as moeify's ``--set KEY=VALUE`` arguments."""
    return [arg for key, value in options.items() for arg in ("--set", f"{key}={value}")]


def command(run: Run, out: Path, extra: list[str]) -> list[str]:
    """The ``moeify compare`` command line of ``run``'s methods."""
    out.parent.mkdir(parents=True, exist_ok=True)
    eval_file = write_eval_prefix(EVAL_CHARS, out.parent)
    sets = set_args({key: value for key, value in {**METHOD_OPTIONS, **RECOVERY, **run.sets}.items()
                     if "." not in key or key.split(".")[0] in run.methods})
    return [sys.executable, "-m", "moeify", "compare", str(MODEL), "--methods", ",".join(run.methods),
            "--active", str(ACTIVE), "--out", str(out), "--calib", str(CALIB), "--eval", str(eval_file),
            "--seq-len", "2048", "--recover-tokens", ",".join(map(str, BUDGETS)), *sets, *extra]


def collect(run: Run, out: Path) -> list[dict[str, Any]]:
    """One row per method of the run in ``out``: its compare.json and records, and, for a run still going (or
    stopped, to be resumed), the methods it has finished so far."""
    summaries = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else []
    summaries += [{"method": m, "matched": "(run not finished)", "folder": str(out / m)}
                  if (out / m / "record.json").is_file() else {"method": m, "matched": "-", "error": NOT_RUN}
                  for m in run.methods if m not in {s["method"] for s in summaries}]  # an earlier run's compare.json
    rows = []
    for summary in summaries:
        row: dict[str, Any] = {"method": summary["method"], "matched": summary["matched"],
                               "options": summary.get("options"), "error": summary.get("error")}
        if "folder" in summary:
            record = json.loads((Path(summary["folder"]) / "record.json").read_text())
            recovery = record["recovery"]
            row.update(folder=summary["folder"], apr=record["active"]["apr"], dense_ppl=record["metrics"]["dense_ppl"],
                       ppl_before=record["pre_recovery"]["ppl"], ppl=record["metrics"]["ppl"],
                       curve=[(0, record["pre_recovery"]["ppl"])] + [(p["tokens"], p["ppl"]) for p in recovery["curve"]]
                       + [(recovery["tokens"], record["metrics"]["ppl"])],
                       speedup=record["speed"]["speedup"] if record.get("speed") else None,
                       speed_spread=max(record["speed"]["spread"].values()) if record.get("speed") else None,
                       convert_s=record["timings"]["convert_s"], recover_s=recovery["wall_s"],
                       trainable_params=recovery["trainable_params"], recovery_options=recovery["options"],
                       eval=record["data"]["eval"], versions=record["versions"])
        rows.append(row)
    return rows


def label(run: Run, method: str) -> str:
    """A row's name in the table: the method and the options its run sets beyond the table's (``refit_down``
    for ``refit_down=true``, else ``KEY=VALUE``)."""
    extra = [key.split(".")[-1] if value == "true" else f"{key.split('.')[-1]}={value}"
             for key, value in run.sets.items() if RUNS[DEFAULT_RUN].sets.get(key) != value
             and ("." not in key or key.startswith(f"{method}."))]
    return " + ".join([method, *extra])


def markdown() -> str:
    """The table: the finished rows of the table's run and of ``TABLE_RUNS`` (named by ``label``), by
    perplexity after the largest budget; the table's methods not run yet, or failed, after them."""
    rows = rows_of(RUNS[DEFAULT_RUN])
    finished = [(RUNS[name], label(RUNS[name], r["method"]), r) for name in (DEFAULT_RUN, *TABLE_RUNS)
                for r in rows_of(RUNS[name]) if "curve" in r]
    budgets = [t for t, _ in finished[0][2]["curve"]] if finished else []
    head = " | ".join(f"PPL after {t // 1000}k" for t in budgets[1:])
    lines = [f"| method | APR | PPL before | {head} | x dense | native speed-up (8 x 256) | convert s | recovery s |",
             "|---|---|---|" + "---|" * (len(budgets) - 1) + "---|---|---|---|"]
    for run, name, r in sorted(finished, key=lambda f: f[2]["ppl"]):
        after = " | ".join(f"{ppl:.2f}" for _, ppl in r["curve"][1:])
        speed = speed_cell(run, r)
        apr = f"{r['apr']:.3f}" + (" (off target)" if abs(r["apr"] - ACTIVE) > APR_TOLERANCE else "")
        lines.append(f"| {name} | {apr} | {r['ppl_before']:.2f} | {after} | "
                     f"{r['ppl'] / r['dense_ppl']:.2f} | {speed} | {r['convert_s']:.0f} | {r['recover_s']:.0f} |")
    lines += [f"| {r['method']} | {r['error'] if r['error'] == NOT_RUN else 'failed: ' + r['error']} |"
              for r in rows if "curve" not in r]
    dense = finished[0][2]["dense_ppl"] if finished else None
    return "\n".join(lines) + ("" if dense is None else f"\n\nDense SmolLM2-135M on the same text: {dense:.2f}.")


def speed_cell(run: Run, row: dict[str, Any]) -> str:
    """The native speed-up of a row: its quiet ``moeify bench`` (8 x 256 prefill) where there is one, else
    the run's own speed pass, flagged where its spread says it was disturbed."""
    bench = run.bench / f"{row['method']}.json"
    if bench.is_file():
        prefill = {p["batch_size"]: p["speedup"] for p in json.loads(bench.read_text())["prefill"]}
        return f"{prefill[8]:.2f}x (moeify bench)"
    if not row["speedup"]:
        return "-"
    noisy = (row.get("speed_spread") or 0) > NOISY_SPREAD
    return f"{row['speedup']:.2f}x (run's pass" + (f", disturbed: spread {row['speed_spread']:.0%})" if noisy else ")")


def versus() -> str:
    """Each method's perplexity after each budget with each loss it was recovered with."""
    finished = {(loss, r["method"]): r for loss in LOSSES for r in rows_of(RUNS[loss]) if "curve" in r}
    budgets = (0, *BUDGETS)
    lines = ["| method | loss | PPL before | " + " | ".join(f"after {t // 1000}k" for t in BUDGETS) + " |",
             "|---|---|" + "---|" * len(budgets)]
    for method in KD_METHODS:
        for loss in LOSSES:
            if (r := finished.get((loss, method))) or method in RUNS[loss].methods:
                cells = [f"{ppl:.2f}" for _, ppl in r["curve"]] if r else [NOT_RUN] + ["-"] * (len(budgets) - 1)
                lines.append(f"| {method} | {LOSS_NAMES[loss]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ``--transfer``: the models of every loss on text and tasks unlike the training text (WikiText): the first
# EVAL_CHARS characters of each text, the first TRANSFER_LIMIT items of each zero-shot task
TRANSFER_TEXTS = {"ptb": ASSETS / "data" / "ptb" / "ptb.test.txt",
                  "tinystories": ASSETS / "data" / "tinystories" / "tinystories_valid_dev.txt"}
TRANSFER_TASKS = ("arc_easy", "piqa", "hellaswag", "winogrande")
TRANSFER_LIMIT = 300
TRANSFER = RESULTS / "compare_recovery_transfer.jsonl"


def transfer() -> None:
    """``moeify eval`` of the dense model and of every method's models recovered by each loss (where the
    run's folder exists), its rows written to ``TRANSFER``; an evaluation already in ``MODELS/transfer_texts`` is
    read, not run again."""
    texts = MODELS / "transfer_texts"
    texts.mkdir(parents=True, exist_ok=True)
    data = []
    for name, path in TRANSFER_TEXTS.items():
        (prefix := texts / f"{name}_first{EVAL_CHARS}.txt").write_text(path.read_text()[:EVAL_CHARS])
        data += ["--data", str(prefix)]
    models = [("dense", "-", MODEL)] + [(m, loss, RUNS[loss].out / m) for m in KD_METHODS for loss in LOSSES
                                        if (RUNS[loss].out / m / "record.json").is_file()]
    rows = []
    for method, loss, model in models:
        result = texts / f"{loss}_{method}.json"  # kept: a run stopped part way continues where it was
        if not result.is_file():
            subprocess.run([sys.executable, "-m", "moeify", "eval", str(model), *data, "--seq-len", "2048",
                            "--tasks", ",".join(TRANSFER_TASKS), "--task-data", str(ASSETS / "data"),
                            "--limit", str(TRANSFER_LIMIT), "--json", str(result)], check=True)
        scores = json.loads(result.read_text())
        tasks = {task: {"metric": "acc_norm" if "acc_norm" in v else "acc", "value": v.get("acc_norm", v["acc"]),
                        "n": v["n"]} for task, v in scores["tasks"].items()}
        rows.append({"method": method, "loss": loss, "ppl": scores["ppl"], "tasks": tasks, "model": str(model)})
    write_output_file(TRANSFER, "".join(json.dumps(row) + "\n" for row in rows))


def transfer_markdown() -> str:
    """The ``TRANSFER`` rows: perplexity per text and accuracy per task, each method's two losses together."""
    rows = [json.loads(line) for line in TRANSFER.read_text().splitlines()] if TRANSFER.is_file() else []
    lines = ["| model | loss | " + " | ".join(f"PPL {t}" for t in TRANSFER_TEXTS) + " | "
             + " | ".join(TRANSFER_TASKS) + " |", "|---|---|" + "---|" * (len(TRANSFER_TEXTS) + len(TRANSFER_TASKS))]
    for r in rows:
        cells = [f"{v:.2f}" for v in r["ppl"].values()] + [f"{r['tasks'][t]['value']:.3f}" for t in TRANSFER_TASKS]
        lines.append(f"| {r['method']} | {LOSS_NAMES.get(r['loss'], r['loss'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nPerplexity on the first {EVAL_CHARS:,} characters of each text; tasks: the first "
                               f"{TRANSFER_LIMIT} items each (acc_norm where lm-eval gives it, else acc).")


def rows_of(run: Run) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.results.read_text().splitlines()] if run.results.is_file() else []


def merge(kept: list[dict[str, Any]], new: list[dict[str, Any]], order: tuple[str, ...]) -> list[dict[str, Any]]:
    """The results file's rows after a run of some methods: each method's new row, but a finished row is never
    replaced by one not finished; methods the run did not touch keep their rows; in the comparison's order."""
    rows = {r["method"]: r for r in kept}
    for row in new:
        if "curve" in row or "curve" not in rows.get(row["method"], {}):
            rows[row["method"]] = row
    return [rows.get(m, {"method": m, "matched": "-", "options": None, "error": NOT_RUN}) for m in order]


def bench(run: Run, rows: list[dict[str, Any]]) -> None:
    """``moeify bench`` of each finished row's folder that has no bench file yet (the CPU to itself)."""
    run.bench.mkdir(parents=True, exist_ok=True)
    for row in rows:
        target = run.bench / f"{row['method']}.json"
        if "curve" in row and not target.is_file():
            subprocess.run([sys.executable, "-m", "moeify", "bench", row["folder"], *BENCH_ARGS,
                            "--json", str(target)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", choices=sorted(RUNS), default=DEFAULT_RUN,
                        help="mix: every method at the recovery's defaults (half distillation, half the LM loss; the "
                             f"table); refit: {', '.join(REFIT_METHODS)} with refit_down=true; attention: cmoe "
                             "with the refit and half the attention thresholded; attention_lr, attention_lr1e-4: that "
                             "at recover_lr=1.5e-4, 1e-4; attention_linear: at recover_lr_schedule=linear (rows of "
                             "the table); "
                             "the comparison of the losses, at its settings (LOSS_COMPARISON): lm, the LM "
                             f"loss alone; kd: {', '.join(KD_METHODS)} distilled; mix_b4: cmoe and static_prune with "
                             "half of each")
    parser.add_argument("--out", type=Path, help="the comparison's folder (default: one per --run)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--collect", action="store_true", help="only write the rows of the run in --out")
    parser.add_argument("--markdown", action="store_true", help="print the table of the results file")
    parser.add_argument("--bench", action="store_true",
                        help="moeify bench each finished row's folder that has no bench file yet, then exit")
    parser.add_argument("--transfer", action="store_true",
                        help=f"evaluate {', '.join(KD_METHODS)} recovered by each loss on other text and zero-shot "
                             "tasks (with --markdown: print that table)")
    parser.add_argument("--methods", help="comma-separated part of the comparison's methods to run (default: all)")
    args = parser.parse_args()
    run = RUNS[args.run]
    if args.methods:
        picked = tuple(args.methods.split(","))
        if unknown := [m for m in picked if m not in run.methods]:
            parser.error(f"--methods {','.join(unknown)}: not in this comparison ({','.join(run.methods)})")
        run = replace(run, methods=picked)
    out = args.out or run.out
    if args.transfer:
        if not args.markdown:
            transfer()
        print(transfer_markdown())
        return
    if args.markdown:
        print(table(args.run))
        return
    if args.bench:
        bench(run, [r for r in rows_of(run) if r["method"] in run.methods])
        return
    if not args.collect:
        done = subprocess.run(command(run, out, ["--resume"] if args.resume else []), check=False)
        if done.returncode:
            sys.exit(done.returncode)
    rows = merge(rows_of(run), collect(run, out), RUNS[args.run].methods)
    write_output_file(run.results, "".join(json.dumps(row) + "\n" for row in rows))
    finished = [r for r in rows if "curve" in r]
    if finished and run.curve is not None:
        from moeify.report.build import recovery_plot

        run.curve.write_bytes(recovery_plot({r["method"]: r["curve"] for r in finished}, finished[0]["dense_ppl"]))
    print(table(args.run))


def table(run_name: str) -> str:
    """What ``--markdown`` prints for a run: a loss's, the losses side by side; else the table."""
    return versus() if run_name in LOSSES else markdown()


if __name__ == "__main__":
    main()
