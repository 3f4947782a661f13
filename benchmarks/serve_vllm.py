"""vLLM serves what moeify makes: exports of SmolLM2-135M by every method give moeify's own greedy tokens.

Run with the python of the vLLM virtual environment, which ``benchmarks/make_vllm_venv.sh`` makes (vLLM's
CPU build with moeify installed beside it):

    .venv-vllm/bin/python benchmarks/serve_vllm.py [--rows more,tomoe,dense2moe,static_prune,cmoe,...] [--speed]
        [--work /tmp/moeify-serve] [--out benchmarks/results/serve_vllm.jsonl]

For each method: convert SmolLM2 (the GGUF in ../shared/assets, float32; calibration and training on WikiText-2
valid at small budgets: what is checked here is the export, not the conversion's quality), export it to the
format that represents it (``EXPORTS``: exactly, or ``--approximate``: routers distilled to linear ones,
per-token parts made static; or ``--dense-layers auto``: a wide layer written dense), then decode greedily
``--new-tokens`` tokens for 8 prompts (the first 32 tokens of 8 WikiText-2 test paragraphs) in vLLM (float32,
eager) and with moeify's native model, and compare the tokens (``moeify.evaluation.serving``). An exact export
must give identical tokens; an approximate one is a different model, so beside its token agreement stand its
parts' agreement and perplexity change on held-out text (from its export record), and the served tokens are also
compared with the export's own in transformers. The dense model, served and run by transformers, is the first
row: the engine's own agreement. One JSON line per row is appended to ``--out``; ``--markdown`` prints the table
from it.

``--speed`` measures instead, in one run, what vLLM serves per second in bfloat16: a batch of
``SPEED_PROMPTS`` prompts of ``SPEED_PROMPT_TOKENS`` tokens (WikiText-2 test) plus ``--new-tokens``
generated, dense and every export, beside the FLOP-ideal speed-up (``macs_per_token`` of the dense model
over the export's, padding included); rows go to ``SPEED_OUT``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_real import CALIB, EVAL, MODEL  # this folder is on sys.path when run

OUT = Path(__file__).resolve().parent / "results" / "serve_vllm.jsonl"
SPEED_OUT = Path(__file__).resolve().parent / "results" / "serve_vllm_speed.jsonl"
PROMPTS, PROMPT_TOKENS = 8, 32
SPEED_PROMPTS, SPEED_PROMPT_TOKENS = 32, 350
EVAL_CHARS = 20000  # held-out text for the conversions' and approximations' perplexities
EXACT: tuple[str, ...] = ()
APPROXIMATE = ("--approximate",)
TOMOE_250 = {"attention": "off", "steps": 250, "recompute": False, "checkpoint_every": 25}
# row -> (method, conversion options, export format, `moeify export` options beyond the format)
EXPORTS: dict[str, tuple[str, dict[str, Any], str, tuple[str, ...]]] = {
    "more": ("more", {}, "qwen2_moe", EXACT),
    "more-granitemoeshared": ("more", {}, "granitemoeshared", EXACT),  # the llama.cpp-safe format
    "tomoe": ("tomoe", {"attention": "off", "steps": 10, "checkpoint_every": 0}, "qwen2_moe", EXACT),
    # trained long enough for its experts to share most neurons: the shared part the export serves densely
    "tomoe-250": ("tomoe", TOMOE_250, "qwen2_moe", EXACT),
    # its layer 0 keeps most neurons, which qwen2_moe's single widths would impose on every layer: dense
    "tomoe-250-dense": ("tomoe", TOMOE_250, "qwen2_moe", ("--dense-layers", "auto")),
    "dense2moe": ("dense2moe", {"steps": 10, "warmup": 2, "seq_len": 256, "checkpoint_every": 0}, "qwen2_moe", EXACT),
    "static_prune": ("static_prune", {}, "llama", EXACT),  # pruned head dimensions zero-padded back
    "static_prune-mlp": ("static_prune", {"attention": "off"}, "llama", EXACT),
    # S2A2E16: top-2 with unit weights, routers distilled to renormalised weights
    "cmoe": ("cmoe", {}, "qwen2_moe", APPROXIMATE),
    # the other default conversions, approximated: per-token attention dimensions made static (ToMoE),
    # the threshold router at its most common expert count (DSMoE), the input thresholds dropped (TEAL)
    "tomoe-attention": ("tomoe", {"steps": 10, "checkpoint_every": 0}, "qwen2_moe", APPROXIMATE),
    "dsmoe": ("dsmoe", {"steps": 10, "checkpoint_every": 0}, "glm4_moe", APPROXIMATE),
    "teal": ("teal", {}, "llama", APPROXIMATE),
}


def moeify_cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "moeify", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"moeify {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def prompts(tokenizer: Any) -> list[list[int]]:
    """The first ``PROMPT_TOKENS`` tokens of the first ``PROMPTS`` long paragraphs of WikiText-2 test."""
    paragraphs = [line.strip() for line in EVAL.read_text().splitlines() if len(line.strip()) > 400]
    return [tokenizer(p)["input_ids"][:PROMPT_TOKENS] for p in paragraphs[:PROMPTS]]


def speed_prompts(tokenizer: Any) -> list[list[int]]:
    """``SPEED_PROMPTS`` consecutive windows of ``SPEED_PROMPT_TOKENS`` tokens of WikiText-2 test."""
    ids = tokenizer(EVAL.read_text()[:200_000])["input_ids"]
    return [ids[i * SPEED_PROMPT_TOKENS:(i + 1) * SPEED_PROMPT_TOKENS] for i in range(SPEED_PROMPTS)]


def speed(name: str, folder: Path, ids: list[list[int]], new_tokens: int, dense_macs: float | None) -> dict[str, Any]:
    """vLLM's bfloat16 throughput on ``folder`` and the multiply-accumulates per token behind it."""
    from transformers import AutoModelForCausalLM

    from moeify.evaluation.serving import served_tokens
    from moeify.evaluation.speed import macs_per_token

    context = SPEED_PROMPT_TOKENS + new_tokens
    macs = macs_per_token(AutoModelForCausalLM.from_pretrained(folder, dtype="bfloat16"), context)
    served = served_tokens(folder, ids, new_tokens, dtype="bfloat16", max_model_len=context + 16)
    generated = sum(len(t) for t in served["tokens"])
    return {"row": name, "served": str(folder), "dtype": "bfloat16", "prompts": len(ids),
            "prompt_tokens": SPEED_PROMPT_TOKENS, "new_tokens": new_tokens, "seconds": round(served["seconds"], 2),
            "tokens_per_s": round(served["tokens_per_s"], 1),
            "generated_per_s": round(generated / served["seconds"], 1),
            "macs_per_token": macs, "ideal_speedup": None if dense_macs is None else dense_macs / macs}


def dense_folder(work: Path) -> Path:
    """SmolLM2 as a float32 transformers folder (vLLM reads the GGUF's tokenizer differently)."""
    from moeify.loading import load_model

    folder = work / "dense"
    if not (folder / "config.json").is_file():
        model, tokenizer = load_model(str(MODEL), dtype="float32")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def exported(row: str, work: Path, eval_text: Path) -> tuple[Path, Path]:
    """(native folder, export folder) of ``row``, converted and exported once."""
    method, options, fmt, export_options = EXPORTS[row]
    name = "-".join([method, *(f"{key}={value}" for key, value in options.items())])
    beyond = [option.lstrip("-") for option in export_options if option not in APPROXIMATE]
    native, export = work / name, work / "-".join([name, fmt, *beyond])
    if not (native / "config.json").is_file():
        sets = [arg for key, value in options.items() for arg in ("--set", f"{key}={value}")]
        moeify_cli("convert", str(work / "dense"), "--method", method, "--out", str(native), "--calib", str(CALIB),
                   "--eval", str(eval_text), "--no-speed", "--overwrite", *sets)
    if not (export / "config.json").is_file():
        extra = [*export_options, "--calib", str(CALIB), "--eval", str(eval_text)] if export_options else []
        moeify_cli("export", str(native), "--format", fmt, "--out", str(export), "--overwrite", *extra)
    return native, export


def check(name: str, native: Path, served: Path, ids: list[list[int]], new_tokens: int) -> dict[str, Any]:
    import moeify
    from moeify.evaluation.serving import compare_tokens, margins_at, native_tokens, served_tokens

    model, _ = moeify.load_model(str(native), dtype="float32")
    expected = native_tokens(model, ids, new_tokens)
    began = time.perf_counter()
    vllm = served_tokens(served, ids, new_tokens)
    row: dict[str, Any] = {"row": name, "native": str(native), "served": str(served), "dtype": "float32",
                           "prompts": len(ids), "new_tokens": new_tokens, **compare_tokens(expected, vllm["tokens"]),
                           "vllm_seconds": round(time.perf_counter() - began, 1)}
    row["native_margin_at_difference"] = margins_at(model, ids, expected, row["first_difference"])
    record_path = served / "moeify_export.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        row.update(format=record["format"], exact=record["exact"], max_abs_logit_diff=record["max_abs_logit_diff"])
        if "approximation" in record:  # a different model: is it served as transformers computes it?
            export_model, _ = moeify.load_model(str(served), dtype="float32")
            row["served_vs_export"] = compare_tokens(native_tokens(export_model, ids, new_tokens), vllm["tokens"])
            a = record["approximation"]
            row["approximation"] = {"agreement": {part: v["held_out_agreement"] for part, v in a["parts"].items()},
                                    **{k: a[k] for k in ("source_ppl", "export_ppl", "ppl_change")}}
    return row


def latest_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of ``path``, the latest measurement of each row name, in first-seen order."""
    latest: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        latest[row["row"]] = row
    return list(latest.values())


def failed(row: dict[str, Any]) -> str:
    """A failed row's cell: the engine's error, its first sentence."""
    cause = row["error"].split(": ", 1)[-1].split(". ")[0].replace("|", "/")
    return f"failed: {cause}"


def markdown(path: Path) -> str:
    """The table of ``path``'s rows (``latest_rows``)."""
    rows = latest_rows(path)
    if rows and "tokens_per_s" in rows[0]:
        lines = ["| row | tokens/s (prompt + generated) | x dense | FLOP-ideal x dense |", "|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['row']} | {failed(r)} | - | - |")
                continue
            ideal = "-" if r["ideal_speedup"] is None else f"{r['ideal_speedup']:.2f}"
            lines.append(f"| {r['row']} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f} | {ideal} |")
        return "\n".join(lines)
    lines = ["| row | format | exact | vLLM = native: identical sequences (token agreement) | vLLM = export "
             "in transformers | approximated part: agreement (held out) | PPL native -> export |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | - | - | {failed(r)} | - | - | - |")
            continue
        d, own = r.get("approximation"), r.get("served_vs_export")
        routing = "-" if d is None else ", ".join(f"{part.replace('_', ' ')} {value:.3f}"
                                                  for part, value in d["agreement"].items())
        ppl = "-" if d is None else f"{d['source_ppl']:.2f} -> {d['export_ppl']:.2f}"
        itself = "-" if own is None else f"{own['identical_sequences']}/{own['sequences']}"
        lines.append(f"| {r['row']} | {r.get('format', '-')} | {r.get('exact', '-')} | "
                     f"{r['identical_sequences']}/{r['sequences']} ({r['token_agreement']:.3f}) | {itself} | "
                     f"{routing} | {ppl} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(EXPORTS), help="rows of EXPORTS, comma-separated")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-serve"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--speed", action="store_true", help="measure bfloat16 serving throughput instead")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(SPEED_OUT if args.speed and args.out == OUT else args.out))
        return
    from transformers import AutoTokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    eval_text = args.work / f"wikitext2_raw_test_first{EVAL_CHARS}.txt"
    eval_text.write_text(EVAL.read_text()[:EVAL_CHARS])
    dense = dense_folder(args.work)
    tokenizer = AutoTokenizer.from_pretrained(dense)
    ids = prompts(tokenizer)
    out = SPEED_OUT if args.speed and args.out == OUT else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    folders = [("dense", lambda: (dense, dense))] + [
        (row, lambda row=row: exported(row, args.work, eval_text)) for row in args.rows.split(",")]
    speed_ids, dense_speed = speed_prompts(tokenizer), None
    for name, made in folders:
        native, served = made()
        try:
            if args.speed:
                row = speed(name, served, speed_ids, args.new_tokens, dense_speed and dense_speed["macs_per_token"])
                dense_speed = dense_speed or row
                row["speedup"] = row["tokens_per_s"] / dense_speed["tokens_per_s"]
            else:
                row = check(name, native, served, ids, args.new_tokens)
        except RuntimeError as error:  # the engine failed on this export: said in its row, the others still run
            if dense_speed is None and args.speed:
                raise
            row = {"row": name, "served": str(served), "error": str(error).splitlines()[0]}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:  # row by row: a failure later keeps what was measured
            f.write(json.dumps(row) + "\n")

if __name__ == "__main__":
    main()
