"""The table of ``serve_llamacpp.py``'s results file (``--markdown``), as the docs show it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamacpp_rows import QUANTS, ROWS, kv_cache_type  # this folder is on sys.path when run
from results_file import read_rows

SPEED_KEYS = ("prompt_tokens_per_s", "generation_tokens_per_s", "prompt_x_dense", "generation_x_dense")


def _agreement_cell(result: dict[str, Any]) -> str:
    return (f"{result['identical_sequences']}/{result['sequences']} / {result['argmax_differences']} of "
            f"{result['forced_positions']}")


def markdown(path: Path) -> str:
    """One line per (row, quantisation, KV cache), the latest of each in the row's latest definition, form
    (its format named with the row) and conversion (``build``): perplexity through llama.cpp and its
    change from the same row's f16, agreement with the native model, and speed against the dense model's in
    the same quantisation, from the quantisation's latest speed run (a row outside it: none), beside the
    FLOP ideal of that run's line; a KV cache
    other than the quantisation's default (``kv_cache_type``) is named in the quant column. Then the rows of
    the converter route (llama.cpp's ``convert_hf_to_gguf.py`` on a standard export, float32), which lines
    without a quantisation hold."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    converted: dict[str, dict[str, Any]] = {}
    measured = read_rows(path)

    def made(line: dict[str, Any]) -> tuple[str, str, str | None]:
        return line["format"], json.dumps(line.get("conversion"), sort_keys=True), line.get("build")

    latest = {line["row"]: made(line) for line in measured if "quant" in line}
    # per quantisation, the rows of its latest speed run: speed is shown from that run alone
    speed_run = {line["quant"]: line["interleaved_with"] for line in measured if "interleaved_with" in line}
    for line in measured:  # a later line's measurements replace an earlier one's, key by key
        if "quant" not in line:
            converted[line["row"]] = line
        elif made(line) == latest[line["row"]]:  # a row converted or written otherwise since: left out
            if line.get("interleaved_with") != speed_run.get(line["quant"]):  # not that run's: no speed
                line = {k: v for k, v in line.items() if k not in SPEED_KEYS}
            rows.setdefault((line["row"], line["quant"], line["kv_cache"]), {}).update(line)
    lines = [("| row | quant | size MiB | PPL (llama.cpp) | vs own f16 | identical greedy / argmax differences "
              "teacher-forced | prompt tok/s | x dense | generation tok/s | x dense | FLOP ideal |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"] if rows else []
    for (name, quant, kv), row in sorted(rows.items(), key=lambda item: (
            list(ROWS).index(item[0][0]), QUANTS.index(item[0][1]), item[0][2] != kv_cache_type(item[0][1], "auto"))):
        default_kv = kv == kv_cache_type(quant, "auto")
        f16 = rows.get((name, "f16", "f16"), {}).get("ppl")
        change = f"{row['ppl'] / f16 - 1:+.1%}" if f16 and "ppl" in row and quant != "f16" else "-"
        agree = _agreement_cell(row) if "identical_sequences" in row else "-"
        if "against_export" in row:  # an approximation: also against what the file holds
            agree += f" (its {row['against_export']['format']} export: {_agreement_cell(row['against_export'])})"
        dense = rows.get(("dense", quant, kv), {})
        ratios = [f"{row[f'{kind}_x_dense']:.2f}x" if f"{kind}_x_dense" in row  # interleaved with dense
                  else f"{row[k] / dense[k]:.2f}x" if k in dense and k in row and name != "dense" else "-"
                  for kind, k in (("prompt", "prompt_tokens_per_s"), ("generation", "generation_tokens_per_s"))]
        timed = "generation_tokens_per_s" in row  # the FLOP ideal stands beside the speed it bounds
        ideal = f"{row['ideal_speedup']:.2f}x" if row.get("ideal_speedup") and timed else "-"
        ppl = f"{row['ppl']:.2f}" if "ppl" in row else "-"
        prompt = f"{row['prompt_tokens_per_s']:.0f}" if "prompt_tokens_per_s" in row else "-"
        generation = f"{row['generation_tokens_per_s']:.1f}" if "generation_tokens_per_s" in row else "-"
        label = quant if default_kv else f"{quant}, KV cache {kv}"
        lines.append(f"| {name} ({row['format']}) | {label} | {row['bytes'] / 2**20:.1f} | {ppl} | {change} | "
                     f"{agree} | {prompt} | {ratios[0]} | {generation} | {ratios[1]} | {ideal} |")
    if converted:
        lines += [""] if lines else []  # a blank line between the two tables
        lines += [("| row (converter route, f32) | format | identical greedy sequences | "
                   "teacher-forced: argmax differences / positions | largest logit difference | NaN |"),
                  "|---|---|---|---|---|---|"]
        for name, row in converted.items():
            if "conversion_error" in row:
                lines.append(f"| {name} | {row['format']} | not converted: {row['conversion_error']} | - | - | - |")
                continue
            forced = f"{row['argmax_differences']} / {row['forced_positions']}" if "forced_positions" in row else "-"
            largest = f"{row['max_abs_logit_diff']:.3f}" if "max_abs_logit_diff" in row else "-"
            lines.append(f"| {name} | {row['format']} | {row['identical_sequences']}/{row['sequences']} | {forced} | "
                         f"{largest} | {'yes' if row['nan_logits'] else 'no'} |")
    return "\n".join(lines)
