"""The GPU speed check's two ends (``gpu_check.sh`` runs the conversions and benches between them):

    python benchmarks/gpu_speed.py build SHAPE OUT    # a random LLaMA-shaped bfloat16 model folder
    python benchmarks/gpu_speed.py summarize WORK OUT.json
    python benchmarks/gpu_speed.py markdown [OUT.json]   # the docs' tables (default: the committed result)

``build``: weights from ``torch.manual_seed(0)`` (no download), moeify's embedded tokenizer (its ids are
below every shape's vocabulary), built on the GPU where there is one. Shapes: ``7b`` (LLaMA-2-7B), ``1b``
(TinyLlama-1.1B), ``tiny`` (a dry run of the script on a CPU); ``7b-4`` and ``1b-4``: four layers of those
(a layer's kernels and speed in seconds, ``gpu_profile.py``).

``summarize``: one JSON file from the run folder WORK: the device, the versions, every conversion's times,
planned and measured peaks and activated ratio, every bench (eager and compiled), and each line of the
check with its measured value, its target and whether it holds. ``markdown``: that file as two tables, the
lines and every bench's shapes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from moeify.presets import PRESETS

SHAPES = {
    "7b": PRESETS["llama-2-7b"],
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=1024, max_position_embeddings=2048),
}
SHAPES.update({f"{name}-4": {**shape, "num_hidden_layers": 4} for name, shape in SHAPES.items() if name != "tiny"})
# (run folder in WORK, the conversion's meaning): what gpu_check.sh converts, by the shape it converts
RUNS = {"cmoe": "CMoE S1A1E8 of the larger shape", "more": "MoRE of the larger shape",
        "tomoe": "ToMoE at APR 0.5, a few steps, of the smaller shape",
        "dsmoe": "DSMoE at APR 0.5 (tau set after a few steps), of the smaller shape"}
PLAN_TOLERANCE = 0.25
RESULT = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def build(shape: str, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from moeify.loading import load_model

    if shape not in SHAPES:
        raise SystemExit(f"shape {shape!r} is unknown; shapes: {', '.join(SHAPES)}")
    began = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(torch.bfloat16)
    model.save_pretrained(out)
    load_model(None)[1].save_pretrained(out)
    print(f"built {shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters in "
          f"{time.perf_counter() - began:.0f} s -> {out}")


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _speedup(bench: dict[str, Any] | None, kind: str, batch: int, tokens: int | None = None) -> float | None:
    if bench is None:
        return None
    for row in bench[kind]:
        if row["batch_size"] == batch and (tokens is None or row["seq_len"] == tokens):
            return row["speedup"]
    return None


def _line(what: str, value: float | None, target: float, at_most: bool = False) -> dict[str, Any]:
    holds = None if value is None else (value <= target if at_most else value >= target)
    return {"line": what, "value": value, "target": f"{'<=' if at_most else '>='} {target}", "holds": holds}


def summarize(work: Path, out: Path) -> None:
    import torch

    runs = {}
    for name in RUNS:
        record = _read(work / name / "record.json")
        bench = {mode: _read(work / f"{name}_bench_{mode}.json") for mode in ("eager", "compiled")}
        runs[name] = None if record is None else {
            "meaning": RUNS[name], "convert_s": record["timings"]["convert_s"], "apr": record["active"]["apr"],
            "memory": record["memory"], "speed_pass": record.get("speed"), "bench": bench}
    lines = []
    cmoe = runs["cmoe"]
    if cmoe:
        compiled, eager = cmoe["bench"]["compiled"], cmoe["bench"]["eager"]
        lines += [_line("cmoe compiled prefill 8x256", _speedup(compiled, "prefill", 8, 256), 1.4),
                  _line("cmoe compiled decode b=1", _speedup(compiled, "decode", 1), 1.3),
                  _line("cmoe compiled decode b=32", _speedup(compiled, "decode", 32), 0.95),
                  _line("cmoe eager: slowest shape", min((r["speedup"] for kind in ("prefill", "decode")
                                                          for r in eager[kind]), default=None) if eager else None, 0.9),
                  _line("cmoe conversion s", cmoe["convert_s"], 60, at_most=True)]
    if runs["more"]:
        lines.append(_line("more conversion s", runs["more"]["convert_s"], 120, at_most=True))
    for name in ("tomoe", "dsmoe"):
        if runs[name]:
            for mode in ("compiled", "eager"):
                lines.append(_line(f"{name} {mode} prefill 8x256", _speedup(runs[name]["bench"][mode], "prefill", 8, 256),
                                   1.2))
    for name, run in runs.items():
        if run and run["memory"].get("peak_device_gib"):
            off = run["memory"]["plan_gib"] / run["memory"]["peak_device_gib"] - 1
            lines.append(_line(f"{name} plan / device peak - 1 (absolute)", abs(off), PLAN_TOLERANCE, at_most=True))
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
               "versions": next((_read(work / n / "record.json")["versions"] for n in RUNS if runs[n]), {}),
               "lines": lines, "runs": runs}
    out.write_text(json.dumps(summary, indent=2) + "\n")
    for line in lines:
        value = "not measured" if line["value"] is None else f"{line['value']:.3g}"
        mark = {True: "ok  ", False: "MISS", None: "--  "}[line["holds"]]
        print(f"{mark} {line['line']}: {value} (target {line['target']})")
    print(f"wrote {out}")


def markdown(result: Path) -> None:
    summary = json.loads(result.read_text())
    print(f"On {summary['device']}, torch {summary['versions'].get('torch')}, bfloat16:\n")
    print("| line | measured | target | holds |\n|---|---|---|---|")
    for line in summary["lines"]:
        value = "not measured" if line["value"] is None else f"{line['value']:.3g}"
        print(f"| {line['line']} | {value} | {line['target']} | "
              f"{ {True: 'yes', False: 'no', None: '-'}[line['holds']]} |")
    print("\n| conversion | mode | shape | dense tokens/s | MoE tokens/s | speed-up |\n|---|---|---|---|---|---|")
    benches = [(name, mode, bench) for name, run in summary["runs"].items() if run
               for mode, bench in run["bench"].items() if bench]
    for name, mode, bench in benches:
        rows = [(f"prefill {r['batch_size']} x {r['seq_len']}", r) for r in bench["prefill"]] + \
            [(f"decode batch {r['batch_size']}", r) for r in bench["decode"]]
        for shape, r in rows:
            print(f"| {name} | {mode} | {shape} | {r['dense']:,.0f} | {r['moe']:,.0f} | {r['speedup']:.2f}x |")


if __name__ == "__main__":
    command, *args = sys.argv[1:] or ["--help"]
    if command == "build" and len(args) == 2:
        build(args[0], Path(args[1]))
    elif command == "summarize" and len(args) == 2:
        summarize(Path(args[0]), Path(args[1]))
    elif command == "markdown" and len(args) <= 1:
        markdown(Path(args[0]) if args else RESULT)
    else:
        raise SystemExit(__doc__)
