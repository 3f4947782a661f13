"""What the standard-format export changes in float32, and what its expert layout costs on this machine.

A MoRE conversion (shared backbone, unequal petals: the case where the layouts differ most) of a
LLaMA-shaped random model is exported to qwen2_moe and glm4_moe in memory, then, in the same run:

* ``max_abs_dlogits``: float32 logits of the export against the native model, on one batch;
* ``max_abs_dlogits_export_mlps_in_native``: the same after putting the export's own MLP blocks into
  the native model in place of its MoE layers. Zero means every other piece (attention, norms,
  embeddings, head) is bit-identical and the whole float32 gap is the MoE layers' kernel layout (the
  native runtime runs each expert at its own width with separate gate/up matmuls; transformers runs
  them zero-padded to one width with one fused gate/up matmul, through grouped_mm);
* prefill and decode tokens/s of the dense model, the native model (its packed inference path), the
  native model on its per-expert path (each expert's own modules, what training runs) and each export:
  what computing in the export's layout costs or gains.

One JSON line per run is appended to ``--out``; ``--markdown`` prints the table of every run that file holds.

    python benchmarks/bench_export_layout.py [--layers 8] [--batch 8] [--seq 512] [--repeats 3]
        [--out benchmarks/results/bench_export_layout.jsonl]
    python benchmarks/bench_export_layout.py --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING

from results_file import append_row, read_rows  # this folder is on sys.path when run

if TYPE_CHECKING:
    import torch

FORMATS = ("qwen2_moe", "glm4_moe")
OUT = Path(__file__).resolve().parent / "results" / "bench_export_layout.jsonl"


def with_export_mlps(native: torch.nn.Module, export: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``native`` whose MLP slots hold ``export``'s MLP blocks (same layer indices)."""
    from moeify.arch import DecoderAdapter

    hybrid = copy.deepcopy(native)
    adapter = DecoderAdapter(hybrid)
    for i in range(adapter.num_layers):
        parent, _, name = adapter.mlp_path(i).rpartition(".")
        setattr(hybrid.get_submodule(parent), name, export.model.layers[i].mlp)
    return hybrid


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module, ids: torch.Tensor) -> float:
    import torch

    with torch.no_grad():
        return float((a(ids).logits - b(ids).logits).abs().max())


@contextlib.contextmanager
def per_expert_path():
    """MoE layers without their packed copy: the per-expert path runs at inference too."""
    from moeify.runtime.moe import MoeMLP

    current_pack = MoeMLP._current_pack
    MoeMLP._current_pack = lambda self: None
    try:
        yield
    finally:
        MoeMLP._current_pack = current_pack


def speeds(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, float]:
    from moeify.evaluation.speed import decode_speed, forward_tokens_per_s

    return {"prefill_tokens_per_s": round(forward_tokens_per_s(model, args.batch, args.seq, repeats=args.repeats,
                                                               warmup=1), 1),
            "decode_tokens_per_s": round(decode_speed(model, 1, 32, args.new_tokens, repeats=args.repeats)[0], 1)}


def measure(args: argparse.Namespace) -> dict:
    """Convert, export and time; the JSON row."""
    import torch
    from random_llama import VOCAB, conversion_context, random_llama, shape  # this folder is on sys.path when run

    from moeify.export.hf_export import EXPORTERS
    from moeify.methods.more import MoreConfig
    from moeify.methods.more.convert import convert
    from moeify.moe.accounting import moe_layers
    from moeify.runtime.moe import set_packed_widths

    dense = random_llama(args.layers)
    ctx = conversion_context(dense)
    convert(ctx, MoreConfig(calib_samples=8, seq_len=512))
    native = ctx.model.eval()
    set_packed_widths(native)  # the model-wide widths, as moeify.convert and loading set them
    petals = [[e.width for e in layer.experts] for layer in moe_layers(native)]
    ids = torch.randint(0, VOCAB, (2, 256), generator=torch.Generator().manual_seed(1))
    record = {"bench": "export_layout", "shape": shape(args.layers), "method": "more",
              "batch": args.batch, "seq": args.seq, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "petal_widths": petals, "packed_width": next(m.packed_widths[0] for m in moe_layers(native) if m.router is not None),
              "threads": torch.get_num_threads(), "dense": speeds(dense, args), "native": speeds(native, args)}
    with per_expert_path():
        record["native_per_expert"] = speeds(native, args)
    for fmt in FORMATS:
        start = time.perf_counter()
        export = EXPORTERS[fmt].build(native).model.eval()
        record[fmt] = {"build_s": round(time.perf_counter() - start, 1),
                       "max_abs_dlogits": max_abs_diff(export, native, ids),
                       "max_abs_dlogits_export_mlps_in_native": max_abs_diff(export, with_export_mlps(native, export),
                                                                             ids),
                       **speeds(export, args)}
    return record


MODELS = (("dense", "dense"), ("native", "native (packed)"), ("native_per_expert", "native, per-expert path"),
          *((fmt, f"{fmt} export") for fmt in FORMATS))


def _diff(value: float) -> str:
    return f"{value:.1e}" if value else "0"


def markdown(path: Path) -> str:
    """The table of every run in ``path``: each model's prefill and decode tokens/s (prefill x dense), and
    each export's float32 logit difference to the native model."""
    lines = [("| run | model | prefill tokens/s (x dense) | decode tokens/s | max \\|Δlogits\\| to native, float32 "
              "(with the export's MLP blocks in the native model) |"), "|---|---|---|---|---|"]
    rows = read_rows(path)
    for run, r in enumerate(rows, 1):
        dense = r["dense"]["prefill_tokens_per_s"]
        for key, name in MODELS:
            m = r[key]
            exact = (f"{_diff(m['max_abs_dlogits'])} ({_diff(m['max_abs_dlogits_export_mlps_in_native'])})"
                     if "max_abs_dlogits" in m else "-")
            lines.append(f"| {run} | {name} | {m['prefill_tokens_per_s']:.1f} "
                         f"({m['prefill_tokens_per_s'] / dense:.2f}x) | {m['decode_tokens_per_s']:.1f} | {exact} |")
    lines += ["", "Run " + "; run ".join(
        f"{run}: {r['shape']}, MoRE's petals {min(min(w) for w in r['petal_widths'])}-"
        f"{max(max(w) for w in r['petal_widths'])} neurons wide, padded to W = {r['packed_width']}; prefill "
        f"{r['batch']} x {r['seq']} tokens, decode {r['new_tokens']} tokens after a 32-token prompt at batch 1; "
        f"median of {r['repeats']} timed passes"
        for run, r in enumerate(rows, 1)) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT, help="results file the JSON line is appended to")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    append_row(args.out, measure(args))


if __name__ == "__main__":
    main()
