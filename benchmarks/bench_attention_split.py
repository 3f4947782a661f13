"""How CMoE with TEAL's attention thresholds should spend APR 0.5, chosen on short recoveries: each variant is
``moeify compare`` of CMoE alone at APR 0.5 with the output refit and ``attention_sparsity`` (the MLP matched to
what the thresholds leave, or a ``spec`` given), then ``moeify recover`` of that conversion for ``TOKENS``
tokens of WikiText-2 valid with the comparison's recovery settings (``compare_recovery.RECOVERY``) and the
variant's. Both evaluate on 50,000 characters of WikiText-2 raw test from ``bench_recovery.EVAL_START``, apart
from the text the comparison's table evaluates on, so the choice does not look at the table's text.

The variants: the attention's share (0.4 / 0.5 / 0.7: more of the attention thresholded leaves the MLP more),
how the MLP's half is split (the matched S2A2E8 or S1A3E8: one shared expert, three of seven routed), the
recovery's learning rate (1.5e-4 / 3e-4, the default / 6e-4) and its schedule (``linear``: falling to 0). A short
recovery ranks structures by how fast they recover, not where they end (a falling rate slows a recovery while it
is fast, and pays off at its end): the chosen variants then run the comparison's whole budget
(``compare_recovery.py --run attention_lr``, ``attention_lr1e-4`` and ``attention_linear``), and ``--full``
evaluates those runs' models on the same held-out text, so that they are ranked apart from the table's text too,
and on text unlike the training text (``compare_recovery.TRANSFER_TEXTS``) beside the dense model.

Each stage is a folder under ``--work`` (``CONVERSION/cmoe`` and ``VARIANT``); one whose folder exists is not
run again, so a sweep stopped part way continues. The rows go to ``OUT``; ``--markdown`` prints them.

    python benchmarks/bench_attention_split.py [--variants a,b] [--work DIR]
    python benchmarks/bench_attention_split.py --full  # after compare_recovery.py's runs of this structure
    python benchmarks/bench_attention_split.py --markdown
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_real import CALIB, EVAL, MODEL  # this folder is on sys.path when run
from bench_recovery import EVAL_START
from compare_recovery import ACTIVE, RECOVERY, RUNS, TRANSFER_TEXTS, set_args
from results_file import append_row, git_commit, read_rows

OUT = Path(__file__).resolve().parent / "results" / "bench_attention_split.jsonl"
FULL_RUNS = ("attention_lr", "attention_lr1e-4", "attention_linear")  # compare_recovery runs of this structure
TOKENS = 30_000
EVAL_CHARS = 50_000
# conversion -> the CMoE options beside the refit (compare matches the spec where none is given)
CONVERSIONS: dict[str, dict[str, str]] = {"s0.4": {"attention_sparsity": "0.4"}, "s0.5": {"attention_sparsity": "0.5"},
                                          "s0.7": {"attention_sparsity": "0.7"},
                                          "s1a3": {"attention_sparsity": "0.5", "spec": "S1A3E8"}}
# variant -> (its conversion, its recovery options beside RECOVERY)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "s0.4": ("s0.4", {}), "s0.5": ("s0.5", {}), "s0.7": ("s0.7", {}), "s1a3": ("s1a3", {}),
    "lr1.5e-4": ("s0.5", {"recover_lr": "0.00015"}), "lr6e-4": ("s0.5", {"recover_lr": "0.0006"}),
    "linear": ("s0.5", {"recover_lr_schedule": "linear"})}


def spec_of(record: dict[str, Any]) -> str:
    """The CMoE spec (``SsAaEe``) a run's record was converted at."""
    config = record["config"]
    return f"S{config['num_shared']}A{config['top_k']}E{config['num_experts']}"


def text_slice(source: Path, start: int, out: Path) -> Path:
    """``EVAL_CHARS`` characters of ``source`` from ``start``, written to ``out``."""
    out.write_text(source.read_text()[start:start + EVAL_CHARS])
    return out


def convert(name: str, work: Path, eval_file: Path) -> Path:
    """The conversion ``name`` (made once): its run folder."""
    out = work / name
    if not (out / "cmoe" / "record.json").is_file():
        options = {"cmoe.refit_down": "true", **{f"cmoe.{k}": v for k, v in CONVERSIONS[name].items()}}
        subprocess.run([sys.executable, "-m", "moeify", "compare", str(MODEL), "--methods", "cmoe", "--active",
                        str(ACTIVE), "--out", str(out), "--calib", str(CALIB), "--eval", str(eval_file),
                        "--seq-len", "2048", *set_args(options), "--overwrite"], check=True)
    return out / "cmoe"


def variant_row(name: str, work: Path, eval_file: Path) -> dict[str, Any]:
    """Recover variant ``name``'s conversion (once) and its row."""
    conversion, options = VARIANTS[name]
    out = work / f"{name}-r{TOKENS // 1000}k"
    if not (out / "record.json").is_file():
        source = convert(conversion, work, eval_file)
        subprocess.run([sys.executable, "-m", "moeify", "recover", str(source), "--tokens", str(TOKENS), "--out",
                        str(out), "--calib", str(CALIB), "--eval", str(eval_file), "--seq-len", "2048",
                        "--no-speed", *set_args({**RECOVERY, **options})], check=True)
    record = json.loads((out / "record.json").read_text())
    return {"variant": name, "conversion": conversion, "cmoe": CONVERSIONS[conversion],
            "spec": spec_of(record), "recovery": options,
            "tokens": record["recovery"]["tokens"],
            "dense_ppl": record["metrics"]["dense_ppl"], "ppl_before": record["pre_recovery"]["ppl"],
            "ppl": record["metrics"]["ppl"], "apr": record["active"]["apr"], "recover_s": record["recovery"]["wall_s"],
            "eval": record["data"]["eval"], "commit": git_commit()}


def evaluate(model: Path | str, texts: list[Path], result: Path) -> dict[str, float]:
    """``moeify eval`` of ``model`` on ``texts`` (kept in ``result``: a sweep stopped part way continues):
    perplexity per text name, and the APR under ``"apr"``."""
    if not result.is_file():
        data = [arg for text in texts for arg in ("--data", str(text))]
        subprocess.run([sys.executable, "-m", "moeify", "eval", str(model), *data, "--seq-len", "2048", "--json",
                        str(result)], check=True)
    scores = json.loads(result.read_text())
    return {**scores["ppl"], "apr": scores["active"]["apr"]}


def full_row(name: str, work: Path, texts: list[Path]) -> dict[str, Any] | None:
    """The model of compare_recovery's run ``name`` (the table's whole budget, where its folder exists)
    evaluated on the held-out text, ``texts[0]``, so that the runs of the whole budget are ranked apart from
    the table's text too (its conversion's perplexity before the recovery was measured on the table's text
    only), and on the other ``texts``, unlike the training text, beside the dense model's."""
    folder = RUNS[name].out / "cmoe"
    if not (folder / "record.json").is_file():
        return None
    scores = evaluate(folder, texts, work / f"full-{name}-texts.json")
    dense = evaluate(MODEL, texts[1:], work / "dense-other-texts.json")
    record, sets = json.loads((folder / "record.json").read_text()), RUNS[name].sets
    return {"variant": name, "conversion": "compare_recovery",
            "cmoe": {"attention_sparsity": sets["cmoe.attention_sparsity"]}, "spec": spec_of(record),
            "recovery": {k: v for k, v in sets.items() if k.startswith("recover_") and k != "recover_lm_share"},
            "tokens": record["recovery"]["tokens"], "dense_ppl": None, "ppl_before": None,
            "ppl": scores[texts[0].name], "apr": scores["apr"], "eval": texts[0].name,
            "other_ppl": {t.name: scores[t.name] for t in texts[1:]},
            "dense_other_ppl": {t.name: dense[t.name] for t in texts[1:]}, "commit": git_commit()}


def other_texts_markdown(rows: list[dict[str, Any]]) -> str:
    """The whole-budget rows' perplexity on the other texts, beside the dense model's."""
    full = [r for r in rows if "other_ppl" in r]
    if not full:
        return ""
    names = list(full[0]["other_ppl"])

    def cells(ppl: dict[str, float]) -> str:
        return " | ".join(f"{ppl[n]:.2f}" for n in names)

    lines = ["| model | " + " | ".join(f"PPL {n.split('_first')[0]}" for n in names) + " |",
             "|---|" + "---|" * len(names), f"| dense | {cells(full[0]['dense_other_ppl'])} |"]
    lines += [f"| {r['variant']} | {cells(r['other_ppl'])} |" for r in full]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| variant | attention thresholded | CMoE spec | recovery lr | lr schedule | tokens | APR | PPL before "
            "| PPL after |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before = "-" if r["ppl_before"] is None else f"{r['ppl_before']:.2f}"
        lines.append(f"| {r['variant']} | {float(r['cmoe']['attention_sparsity']):.0%} | {r['spec']} | "
                     f"{r['recovery'].get('recover_lr', '3e-4 (default)')} | "
                     f"{r['recovery'].get('recover_lr_schedule', 'constant')} | {r['tokens'] // 1000}k | "
                     f"{r['apr']:.3f} | {before} | {r['ppl']:.2f} |")
    dense = f"\n\nDense SmolLM2-135M on the same text: {rows[0]['dense_ppl']:.2f}." if rows else ""
    other = other_texts_markdown(rows)
    return "\n".join(lines) + dense + (f"\n\nThe `200k` rows on other text (the first {EVAL_CHARS:,} characters of "
                                       f"each):\n\n{other}" if other else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-attention-split"))
    parser.add_argument("--full", action="store_true", help="evaluate the models of compare_recovery's runs of "
                        f"this structure ({', '.join(FULL_RUNS)}) on the held-out text and on "
                        f"{', '.join(TRANSFER_TEXTS)}")
    parser.add_argument("--markdown", action="store_true", help="print the table of the results file")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(read_rows(OUT) if OUT.is_file() else []))
        return
    if unknown := [v for v in args.variants.split(",") if v not in VARIANTS]:
        parser.error(f"--variants {','.join(unknown)}: not one of {','.join(VARIANTS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    held_out = f"wikitext2_raw_test_{EVAL_START}_{EVAL_START + EVAL_CHARS}.txt"
    eval_file = text_slice(EVAL, EVAL_START, args.work / held_out)
    done = {r["variant"] for r in read_rows(OUT)} if OUT.is_file() else set()
    if args.full:
        texts = [eval_file, *(text_slice(path, 0, args.work / f"{text}_first{EVAL_CHARS}.txt")
                              for text, path in TRANSFER_TEXTS.items())]
        for name in FULL_RUNS:
            if name not in done and (row := full_row(name, args.work, texts)):
                append_row(OUT, row)
        return
    for name in args.variants.split(","):
        if name not in done:
            append_row(OUT, variant_row(name, args.work, eval_file))


if __name__ == "__main__":
    main()
