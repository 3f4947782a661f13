"""``moeify export``: a converted folder -> a standard Hugging Face MoE architecture (vLLM, SGLang)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeify.cli.common import add_device_arguments
from moeify.cli.format import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export", help="write a converted model as a standard HF model (glm4_moe, qwen2_moe, mixtral; llama if dense)",
        description="Write the converted model in MODEL_DIR as a standard transformers MoE architecture that "
                    "loads without trust_remote_code (and in serving engines), when the format represents the "
                    "conversion exactly; otherwise say why. --check lists what every format says. Non-linear "
                    "routers (CMoE) need --distill-router, which fits linear routers to their decisions: an "
                    "approximation, reported with its routing agreement and perplexity change. The native "
                    "folder written by `moeify convert` stays the lossless format.")
    parser.add_argument("model", type=Path, help="converted model folder (moeify convert --out)")
    parser.add_argument("--format", default=None, help="target architecture (see --check)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (created atomically)")
    parser.add_argument("--check", action="store_true", help="only say which formats represent the model, and why not")
    parser.add_argument("--distill-router", type=int, default=None, metavar="STEPS",
                        help="fit linear routers to non-linear routers' decisions with STEPS optimiser steps")
    parser.add_argument("--calib", default=None, help="distillation text (default: embedded calibration slice)")
    parser.add_argument("--eval", default=None, help="text for the perplexity change (default: embedded "
                                                     "evaluation slice)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    add_device_arguments(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=run)


def _print_check(model: Path) -> int:
    from moeify.api import check_formats

    for support in check_formats(model):
        print(support)
    return 0


def _float32_sums(rearranged: list[int]) -> str:
    if not rearranged:
        return "as the native model's (its MoE layers run in this layout)"
    return (f"rearranged in layers {', '.join(map(str, rearranged))} (a shared part or dense MLP folded into the "
            "experts, or a wider shared part: same function, other float32 rounding)")


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _print_check(args.model)
    if args.format is None or args.out is None:
        raise ValueError("--format and --out are required (or --check to see which formats fit)")
    from moeify.api import export_folder

    record = export_folder(args.model, args.format, args.out, distill_steps=args.distill_router, calib=args.calib,
                           eval=args.eval, seed=args.seed, overwrite=args.overwrite, device=args.device,
                           dtype=args.dtype)
    routed = sum(layer["routed"] for layer in record["layers"])
    rows = [("format", record["format"]),
            ("fidelity", "exact (up to fp rounding)" if record["exact"] else "APPROXIMATE (distilled routers)"),
            ("max |MLP difference|, float64", f"{record['max_abs_mlp_diff_float64']:.3g} (the mapping itself)"),
            *([("max |attention difference|, float64",
                f"{record['max_abs_attention_diff_float64']:.3g} (pruned head dims zero-padded in "
                f"{len(record['padded_attention_layers'])} layers: other float32 sums)")]
              if record["padded_attention_layers"] else []),
            ("max |logit difference|, float32", f"{record['max_abs_logit_diff']:.3g} on {record['probe']}"),
            ("float32 MLP sums", _float32_sums(record["rearranged_layers"])),
            ("routed / dense layers", f"{routed} / {len(record['layers']) - routed}"),
            ("params source -> export", f"{record['params']['source']:,} -> {record['params']['export']:,}")]
    if distill := record.get("distillation"):
        deviation = max(layer["max_weight_dev_from_1"] for layer in distill["layers"])
        rows += [("router agreement calib / held-out",
                  f"{distill['calib_agreement']:.3f} / {distill['held_out_agreement']:.3f} (the chosen set exactly)"),
                 ("max |expert weight - 1|, held-out", f"{deviation:.2g} (top-k renormalised weights)" if deviation
                  else "0 (top-1)"),
                 (f"perplexity on {distill['eval']['name']}",
                  f"{distill['source_ppl']:.3f} -> {distill['export_ppl']:.3f} ({distill['ppl_change']:+.3f})")]
        print("warning: the routers were distilled; the exported model approximates the converted one",
              file=sys.stderr)
    print_table(f"moeify export --format {record['format']}", rows)
    print(f"wrote {args.out}/ (loads with transformers.AutoModelForCausalLM.from_pretrained, no remote code)")
    return 0
