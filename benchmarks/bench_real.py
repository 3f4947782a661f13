"""Every method and baseline on a real LLM (SmolLM2-135M-Instruct, the GGUF in ../shared/assets), one protocol.

Protocol (as the papers): perplexity on a fixed prefix of WikiText-2 raw test (``--eval-chars``, default
the first 100,000 characters), BOS once, non-overlapping 2048-token windows; calibration and training on
WikiText-2 valid (never the evaluation text; a row of ``CALIB_MIXES`` on a mix of corpora). Each row runs
in a fresh process: load, convert, measure perplexity and the activated-parameter ratio (MoRE's APR,
measured on the evaluation tokens), and save the converted model (``--models``). Rows are appended to
``--out`` as JSON lines as they finish, and a rerun skips the rows already there (same name, options and
calibration text), so a long run can be continued. Speed is a
separate pass (``--speed``), run when nothing else shares the CPU: the dense model and each saved model
in one process (``moeify bench``'s ``benchmark_pair``: prefill at batch 1 and 8, greedy decode).
``--markdown`` prints the table of what the file holds; ``--markdown --summary`` a compact one, per method
its best row near APR 0.5 and near APR 0.8.

Rows: the dense model; every method at its defaults; APR 0.5 and 0.8 through each method's own budget
matcher (``moeify compare``'s); 25 % of the MLP for cmoe/random_split/static_prune (S2A2E16); the
paper's ablations; the CMoE light fine-tune recipe and static pruning with the same LoRA budget.

    python benchmarks/bench_real.py [--rows NAME,...|all] [--out benchmarks/results/bench_real.jsonl]
        [--eval-chars 100000] [--models DIR]
    python benchmarks/bench_real.py --speed [--rows ...]    # then, on a quiet machine
    python benchmarks/bench_real.py --markdown [--summary]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from results_file import git_commit  # this folder is on sys.path when run

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
MODEL = ASSETS / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIB = ASSETS / "data" / "wikitext2" / "valid.txt"
PTB_VALID = ASSETS / "data" / "ptb" / "ptb.valid.txt"
TINYSTORIES = ASSETS / "data" / "tinystories" / "tinystories_valid_dev.txt"
EVAL = ASSETS / "data" / "wikitext2_raw" / "wiki.test.raw.txt"
OUT = Path(__file__).resolve().parent / "results" / "bench_real.jsonl"
MODELS = Path(__file__).resolve().parent / "results" / "models"
SEQ_LEN = 2048

# The CPU fine-tuning recipe of docs/results.md: one pass over 384 windows of 512 tokens, 4 per step (96 steps).
RECIPE = {"finetune_samples": 384, "finetune_seq_len": 512, "finetune_batch_size": 4, "lr": 1e-3}
S2A2E16_APR = 0.4375  # static pruning of MLP channels at CMoE S2A2E16's activated-parameter ratio

# name -> (method, options, or {"apr": x} to let the method's budget matcher pick its options)
ROWS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "dense": (None, {}),
    # CMoE against static pruning at the same activated parameters (25 % of the MLP), training-free
    "cmoe_S2A2E16": ("cmoe", {"spec": "S2A2E16"}),
    "static_prune_mlp_S2A2E16": ("static_prune", {"active_ratio": S2A2E16_APR, "attention": "off"}),
    # ... and with the same light LoRA fine-tune (that recipe)
    "cmoe_S2A2E16_recipe": ("cmoe", {"spec": "S2A2E16", **RECIPE}),
    "static_prune_mlp_S2A2E16_lora": ("static_prune", {"active_ratio": S2A2E16_APR, "attention": "off", **RECIPE}),
    "random_split_S2A2E16": ("random_split", {"spec": "S2A2E16"}),
    "cmoe_S2A2E16_signed": ("cmoe", {"spec": "S2A2E16", "router_score": "signed"}),
    # MoRE at its default PR 0.2 (APR 0.8), its ablations, and the baselines at that APR
    "more": ("more", {}),
    "more_random": ("more", {"variant": "random"}),
    "more_backbone": ("more", {"variant": "backbone"}),
    "more_naive": ("more", {"variant": "naive"}),
    "static_prune_apr0.8": ("static_prune", {"apr": 0.8}),
    "teal_apr0.8": ("teal", {"apr": 0.8}),
    "cmoe_apr0.8": ("cmoe", {"apr": 0.8}),
    "random_split_apr0.8": ("random_split", {"apr": 0.8}),
    "tomoe_apr0.8": ("tomoe", {"active_ratio": 0.8, "steps": 40, "checkpoint_every": 0}),
    # APR 0.5: ToMoE's setting
    "tomoe_apr0.5": ("tomoe", {"active_ratio": 0.5, "steps": 40, "checkpoint_every": 0}),
    # ... and its ablations (Table 13: w/o VO routing, Local Emb; Fig. 6c: the LM loss in place of KD)
    "tomoe_apr0.5_no_vo_routing": ("tomoe", {"active_ratio": 0.5, "steps": 40, "checkpoint_every": 0,
                                             "vo_routing": False}),
    "tomoe_apr0.5_mix3": ("tomoe", {"active_ratio": 0.5, "steps": 40, "checkpoint_every": 0}),  # CALIB_MIXES
    "tomoe_apr0.5_head_pruning": ("tomoe", {"active_ratio": 0.5, "steps": 40, "checkpoint_every": 0,
                                            "attention": "heads"}),
    "tomoe_apr0.5_local_emb": ("tomoe", {"active_ratio": 0.5, "steps": 40, "checkpoint_every": 0,
                                         "embeddings": "local"}),
    "tomoe_apr0.5_lm": ("tomoe", {"active_ratio": 0.5, "steps": 40, "checkpoint_every": 0, "objective": "lm"}),
    "static_prune": ("static_prune", {}),
    "teal": ("teal", {}),
    "cmoe_apr0.5": ("cmoe", {"apr": 0.5}),
    # ... at the paper's granularity E16 (APR 0.484, inside 0.5 +- 0.02): 96-neuron experts, top-3 in place of top-6
    "cmoe_S2A3E16": ("cmoe", {"spec": "S2A3E16"}),
    "more_apr0.5": ("more", {"apr": 0.5}),
    "random_split_apr0.5": ("random_split", {"apr": 0.5}),
    # ... at CMoE's budget match S2A2E12, and with the least-squares output refit (not in the papers)
    "cmoe_S2A2E12": ("cmoe", {"spec": "S2A2E12"}),
    "cmoe_S2A2E12_refit": ("cmoe", {"spec": "S2A2E12", "refit_down": True}),
    "static_prune_refit": ("static_prune", {"refit_down": True}),
    # the training methods at a CPU budget, at their papers' learning rates, with their ablations
    "dsmoe": ("dsmoe", {"steps": 20, "lr": 2e-5, "checkpoint_every": 0}),
    # ... with the paper's one learning rate for the gates too
    "dsmoe_one_lr": ("dsmoe", {"steps": 20, "lr": 2e-5, "gate_lr": 2e-5, "checkpoint_every": 0}),
    "dsmoe_no_ste": ("dsmoe", {"steps": 20, "lr": 2e-5, "variant": "no_ste", "checkpoint_every": 0}),
    # ... from the paper's random gates at its one learning rate, which at this budget leave the gates near their
    # start; tau 0.55 in place of 0.5 (APR 0.63 there) switches off enough for about half (tau sets no budget)
    "dsmoe_apr0.5": ("dsmoe", {"steps": 20, "lr": 2e-5, "gate_lr": 2e-5, "gate_init": "random", "tau": 0.55,
                               "checkpoint_every": 0}),
    "dsmoe_defaults": ("dsmoe", {}),  # moeify's: 200 steps of 8 x 256 tokens at lr 2e-4, gates at 1e-2
    "dense2moe": ("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0}),
    "dense2moe_upcycle_weighting": ("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0,
                                                  "router_weighting": "upcycle"}),
    "dense2moe_prune_upcycle": ("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0,
                                              "variant": "prune_upcycle"}),
    "dense2moe_apr0.5": ("dense2moe", {"apr": 0.5, "steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0}),
    "dense2moe_search": ("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0,
                                       "search": True}),  # §2.3's free n*
    "dense2moe_prune_only": ("dense2moe", {"steps": 30, "lr": 1e-4, "seq_len": 256, "checkpoint_every": 0,
                                           "variant": "prune_only"}),
    "cmoe": ("cmoe", {}),
}

# rows that calibrate and train on a mix of corpora (``--calib`` arguments, weights after the colon): ToMoE's
# 1:1:1 mix of three training corpora (the paper's: WikiText, Alpaca, Code-Alpaca; here the three corpora the
# assets hold besides the evaluation text's test split). Every other row: WikiText-2 valid alone.
CALIB_MIXES: dict[str, list[str]] = {
    "tomoe_apr0.5_mix3": [f"{CALIB}:1", f"{PTB_VALID}:1", f"{TINYSTORIES}:1"],
}


def calib_of(name: str) -> list[str]:
    """Row ``name``'s calibration text, as ``--calib`` arguments (file names only in the record)."""
    return CALIB_MIXES.get(name, [str(CALIB)])


def write_eval_prefix(chars: int, folder: Path) -> Path:
    """The evaluation prefix as its own file (its name says which prefix it is)."""
    path = folder / f"wikitext2_raw_test_first{chars}.txt"
    path.write_text(EVAL.read_text()[:chars])
    return path


def _attempts(method: str, options: dict[str, Any], model: Any) -> tuple[list[dict[str, Any]], str]:
    """The options to convert with, in the order to try them (``moeify compare``'s), and how they were chosen:
    the matcher's for APR ``options["apr"]``, each with the row's other options beside (and over) them."""
    if "apr" not in options:
        return [options], "given"
    from moeify.arch import DecoderAdapter
    from moeify.methods import get_method

    rest = {key: value for key, value in options.items() if key != "apr"}
    tries, how = get_method(method).match_budget(options["apr"], DecoderAdapter(model))
    return [{**matched, **rest} for matched in tries], f"matched to APR {options['apr']}: {how}"


def run_row(name: str, eval_file: Path, models: Path) -> dict[str, Any]:
    """Convert, evaluate and save one row in this process (see the module docstring)."""
    import moeify
    from moeify.api import ConversionResult
    from moeify.api.evaluate import evaluate
    from moeify.calibration.corpus import read_corpus
    from moeify.loading import load_model
    from moeify.methods import ConversionContext, get_method
    from moeify.moe.accounting import nominal_activated_parameters
    from moeify.options import build_config

    method, asked = ROWS[name]
    torch.manual_seed(0)
    model, tokenizer = load_model(str(MODEL))
    row: dict[str, Any] = {"row": name, "method": method or "dense", "asked": asked, "calib": _calib_names(name)}
    convert_s = 0.0
    if method is not None:
        attempts, how = _attempts(method, asked, model)
        spec = get_method(method)
        for options in attempts:  # as compare does: the next try when a budget is out of reach
            config = build_config(spec.config_cls, options)
            ctx = ConversionContext(model, tokenizer, read_corpus(calib_of(name)), 0, torch.device("cpu"),
                                    progress=False)
            start = time.perf_counter()
            try:
                conversion = spec.run(ctx, config)
            except ValueError:
                if options is attempts[-1]:
                    raise
                model, tokenizer = load_model(str(MODEL))  # the failed try may have changed it
                continue
            break
        convert_s = time.perf_counter() - start
        model, details = conversion.model.eval(), conversion.details
        nominal = nominal_activated_parameters(model)
        row.update(options=options, how=how, convert_s=round(convert_s, 1),
                   nominal_apr=None if nominal is None else nominal.apr,
                   analysis=details.get("analysis", {}).get("mean"),
                   finetune={k: v for k, v in details.get("finetune", {}).items() if k != "losses"} or None)
        counted = [layer for layer in details.get("layers", []) if "never_activated" in layer]
        if counted:  # MoRE's channel concentration (App. D.2, Table 4), per converted layer
            row["never_activated"] = {"k_act": counted[0]["k_act"],
                                      "per_layer": {layer["layer"]: layer["never_activated"] for layer in counted}}
    result = evaluate(model, tokenizer, [eval_file], seq_len=SEQ_LEN)
    row.update(ppl=result["ppl"][eval_file.name], eval_tokens=result["eval"][eval_file.name]["tokens"],
               apr=result["active"]["apr"], mlp_ratio=result["active"]["mlp_ratio"])
    if method is not None:
        moeify.save(ConversionResult(model, tokenizer, {"method": method, "bench_row": name}), models / name,
                    overwrite=True)
    row["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)
    return row


def measure_speed(out: Path, models: Path, names: list[str]) -> None:
    """The speed pass: the dense model and every saved row model in this process, written into the rows."""
    import moeify
    from moeify.evaluation.bench import benchmark_pair
    from moeify.loading import load_model

    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    dense, _ = load_model(str(MODEL))
    commit = git_commit()
    for row in rows:
        folder = models / row["row"]
        if row["row"] not in names or row["method"] == "dense" or not folder.is_dir():
            continue
        speed = benchmark_pair(dense.eval(), moeify.load(folder), [(1, 256), (8, 256)], [8], prompt_len=256,
                               new_tokens=16, repeats=3) | {"commit": commit}
        # every pass kept: one pass's ratios move by up to a third on this CPU
        row["speed_passes"] = row.get("speed_passes", [row["speed"]] if row.get("speed") else []) + [speed]
        row["speed"] = speed
        print(json.dumps({"row": row["row"], "speedups": _speedups(row)}), flush=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(out)  # atomic: a killed pass leaves the file whole


def _done(out: Path) -> dict[str, dict[str, Any]]:
    if not out.is_file():
        return {}
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {r["row"]: r for r in rows if r["row"] in ROWS and r["asked"] == ROWS[r["row"]][1]
            and r.get("calib", [CALIB.name]) == _calib_names(r["row"])}  # rows before the record: WikiText-2 valid


def _calib_names(name: str) -> list[str]:
    return [Path(spec).name for spec in calib_of(name)]


def _speedups(row: dict[str, Any]) -> str:
    speed = row.get("speed")
    if not speed:
        return "-"
    prefill = " / ".join(f"{p['speedup']:.2f}" for p in speed["prefill"])
    decode = speed["decode"]  # one batch size (a dict) in rows measured before decoding took several
    return f"{prefill} / {(decode[-1] if isinstance(decode, list) else decode)['speedup']:.2f}"


def _passes(row: dict[str, Any]) -> str:
    """The speed-ups of every speed pass of ``row``, first to last."""
    return "; ".join(_speedups({"speed": speed}) for speed in row.get("speed_passes", [row.get("speed")]))


def _options(row: dict[str, Any]) -> str:
    """The row's conversion options as ``key=value`` pairs."""
    return ", ".join(f"{k}={v}" for k, v in (row.get("options") or {}).items())


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    dense = rows.get("dense", {}).get("ppl")
    lines = ["| row | method | options | APR | PPL | x dense PPL | convert s | speed-up prefill b=1 / b=8 / decode |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ROWS:
        if name not in rows:
            continue
        r = rows[name]
        opts = _options(r) or "defaults"
        if name in CALIB_MIXES:
            opts += ", calib=" + " + ".join(_calib_names(name))
        ratio = f"{r['ppl'] / dense:.2f}" if dense else "-"
        lines.append(f"| {name} | {r['method']} | {opts} | {r['apr']:.3f} | {r['ppl']:.2f} | {ratio} | "
                     f"{r.get('convert_s', 0):.0f} | {_speedups(r)} |")
    return "\n".join(lines)


def recheck(now: dict[str, dict[str, Any]], then: dict[str, dict[str, Any]]) -> str:
    """The rows of a re-run (``now``) beside the same rows of an earlier results file (``then``): perplexity,
    APR and speed-ups, so that a re-run after the runtime changed shows what moved and what held."""
    lines = ["| row | options then -> now (where they differ) | PPL then / now | APR then / now | speed-up then: "
             "prefill b=1 / b=8 / decode | now (each pass) | now timed at |", "|---|---|---|---|---|---|---|"]
    for name in ROWS:
        if name in now and name in then:
            was, new = then[name], now[name]
            moved = "" if _options(was) == _options(new) else f"{_options(was)} -> {_options(new)}"
            lines.append(f"| {name} | {moved} | {was['ppl']:.2f} / {new['ppl']:.2f} | {was['apr']:.3f} / "
                         f"{new['apr']:.3f} | {_speedups(was)} | {_passes(new)} | "
                         f"{(new.get('speed') or {}).get('commit', '-')} |")
    return "\n".join(lines)


SUMMARY_APRS = (0.5, 0.8)
SUMMARY_TOLERANCE = 0.06  # below the 0.0625 between APR 0.5 and the S2A2E16 rows (0.4375), another budget


def _summary_cells(row: dict[str, Any] | None, dense: float | None) -> str:
    if row is None:
        return "- | - | - | - | -"
    ratio = f"{row['ppl'] / dense:.2f}" if dense else "-"
    return f"{row['row']} | {row['apr']:.3f} | {row['ppl']:.2f} | {ratio} | {_speedups(row)}"


def summary(rows: dict[str, dict[str, Any]]) -> str:
    """The compact table: per method, its lowest-perplexity row whose measured APR lies within
    ``SUMMARY_TOLERANCE`` of each of ``SUMMARY_APRS``; the dense row first, as the reference of both, then
    the methods in the order ``ROWS`` first names them."""
    dense = rows.get("dense", {}).get("ppl")
    group = "row | APR | PPL | x dense PPL | speed-up prefill b=1 / b=8 / decode"
    lines = ["| method | " + " | ".join(f"near APR {apr}: {group}" for apr in SUMMARY_APRS) + " |",
             "|---|" + "---|---|---|---|---|" * len(SUMMARY_APRS)]
    if "dense" in rows:
        lines.append("| dense | " + " | ".join(_summary_cells(rows["dense"], dense) for _ in SUMMARY_APRS) + " |")
    for method in dict.fromkeys(method for method, _ in ROWS.values() if method is not None):
        own = [rows[name] for name in ROWS if name in rows and rows[name]["method"] == method]
        if not own:
            continue
        best = [min((r for r in own if abs(r["apr"] - apr) <= SUMMARY_TOLERANCE), key=lambda r: r["ppl"], default=None)
                for apr in SUMMARY_APRS]
        lines.append(f"| {method} | " + " | ".join(_summary_cells(r, dense) for r in best) + " |")
    tolerance = f"within ±{SUMMARY_TOLERANCE} of {' and of '.join(map(str, SUMMARY_APRS))}"
    lines += ["", (f"Per method, its row of lowest perplexity among those whose measured APR is {tolerance} "
                   "(ablation variants included; the row column names it in the full table); dashes in place of a "
                   "row: none that near. The dense model (APR 1) is the reference of both; a speed-up \"-\": "
                   "not measured.")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="all", help="comma-separated row names, or all: " + ", ".join(ROWS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--eval-chars", type=int, default=100_000)
    parser.add_argument("--models", type=Path, default=MODELS, help="where the converted models are saved")
    parser.add_argument("--speed", action="store_true", help="measure the speed of the saved models of --rows")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    parser.add_argument("--summary", action="store_true",
                        help="with --markdown: print the compact table instead, one row per method at APR "
                             f"{' and '.join(map(str, SUMMARY_APRS))} (the README's)")
    parser.add_argument("--against", type=Path,
                        help="with --markdown: the rows of --out beside the same rows of this earlier results file")
    parser.add_argument("--run-row", help=argparse.SUPPRESS)  # one row, in this process (the driver's child)
    parser.add_argument("--eval-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_row:
        print(json.dumps(run_row(args.run_row, args.eval_file, args.models)))
        return
    if (args.summary or args.against) and not args.markdown:
        parser.error("--summary and --against go with --markdown")
    if args.markdown:
        rows = _done(args.out)
        print(recheck(rows, _done(args.against)) if args.against else (summary if args.summary else markdown)(rows))
        return
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    if args.speed:
        measure_speed(args.out, args.models, names)
        print(markdown(_done(args.out)))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    with tempfile.TemporaryDirectory() as tmp:
        eval_file = write_eval_prefix(args.eval_chars, Path(tmp))
        for name in names:
            if name in _done(args.out):
                print(f"{name}: already in {args.out}", file=sys.stderr)
                continue
            child = subprocess.run([sys.executable, __file__, "--run-row", name, "--eval-file", str(eval_file),
                                    "--models", str(args.models)], capture_output=True, text=True)
            if child.returncode:
                print(f"{name}: failed\n{child.stderr[-3000:]}", file=sys.stderr)
                continue
            row = json.loads(child.stdout.strip().splitlines()[-1])
            row["eval_file"], row["commit"] = eval_file.name, commit
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: row[k] for k in ("row", "ppl", "apr")} | {"speedups": _speedups(row)}), flush=True)
    print(markdown(_done(args.out)))


if __name__ == "__main__":
    main()
