"""``moeify export``: a converted folder -> a standard Hugging Face MoE architecture (vLLM, SGLang) or a GGUF
file (llama.cpp)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeify.cli.common import add_device_arguments
from moeify.cli.format import print_table

# the export's MLP neurons per token over the conversion's above which the padding is worth a warning
PADDING_WARNING = 1.25


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export", help="write a converted model as a standard HF model (glm4_moe, qwen2_moe, mixtral, "
                       "granitemoeshared; llama if dense) or a GGUF file for llama.cpp",
        description="Write the converted model in MODEL_DIR as a standard transformers MoE architecture that "
                    "loads without trust_remote_code (and in serving engines), when the format represents the "
                    "conversion exactly; otherwise say why. --check lists what every format says. What no format "
                    "computes exactly takes --approximate, which writes its closest form, chosen on calibration "
                    "text: linear routers fitted to non-linear ones (CMoE), threshold routers at their most "
                    "common expert count (DSMoE), static attention dimensions for per-token ones (ToMoE), dense "
                    "projections for thresholded ones (TEAL); --dense-layers writes chosen routed layers as "
                    "dense MLPs, so that one wide layer does not set every layer's width. Each approximated "
                    "part's agreement and the perplexity change are reported. The native folder written by "
                    "`moeify convert` stays the lossless format. --format gguf writes one file that llama.cpp (and "
                    "Ollama, LM Studio) runs: a top-1 routed model in its mixtral form (llama.cpp's llama with "
                    "experts: the shared part folded into every expert, one routed product per layer) where that "
                    "costs no more neurons per token, else its granitemoeshared form (llama.cpp's granitemoe) or, "
                    "for softmax weights that are not renormalised, its qwen2_moe form (qwen2moe); a dense model "
                    "in its llama form; with --approximate, the same choice for what the approximation computes "
                    "(CMoE's fitted top-1 routers: mixtral); with the dense model's tokenizer (from its GGUF file "
                    "or its SentencePiece tokenizer.model), in --quant.")
    parser.add_argument("model", type=Path, help="converted model folder (moeify convert --out)")
    parser.add_argument("--format", default=None, help="target architecture (see --check)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (created atomically); for gguf, the .gguf file")
    parser.add_argument("--quant", default="f16", choices=("f32", "f16", "q8_0", "q4_k_m"),
                        help="gguf only: the type of its matrices (norms and routers stay float32). f32, f16 and "
                             "q8_0 are written by the gguf package; q4_k_m by llama.cpp's quantiser, which needs "
                             "llama-quantize on PATH or llama-cpp-python installed, with llama.cpp's mix of types "
                             "except that an 8-expert model's attention keeps the types of the dense model's "
                             "q4_k_m, where llama.cpp would raise them for Mixtral (default f16)")
    parser.add_argument("--check", action="store_true", help="only say which formats represent the model, and why not")
    parser.add_argument("--approximate", action="store_true",
                        help="write the closest form of what the format cannot represent (measured, reported)")
    parser.add_argument("--dense-layers", default=None, metavar="auto|I,J,...",
                        help="write these routed layers as dense MLPs of every neuron they hold (every expert on; "
                             "unit-weight routers), or 'auto': the layers that make the format's layout run the "
                             "fewest neurons per token. The formats size experts once for all layers, so a layer "
                             "that keeps most neurons pads every other to its width. An approximation: measured "
                             "and reported as --approximate's parts are")
    parser.add_argument("--distill-steps", type=int, default=None, metavar="STEPS",
                        help="optimiser steps of the routers --approximate fits (default 300)")
    parser.add_argument("--calib", default=None, help="text the approximation is chosen on (default: embedded "
                                                      "calibration slice)")
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


def _neurons_row(record: dict) -> str:
    neurons = record["mlp_neurons_per_token"]
    return (f"{neurons['source']:,.0f} as converted -> {neurons['export']:,} in the {record['format']} layout "
            "(all layers; the layout's zero padding included)")


def _warn_padding(record: dict) -> None:
    """Say so where the format's one expert width makes the export run far more MLP neurons per token than
    the conversion: one wide layer pads every other, and the export loses the speed its sparsity promised."""
    neurons = record["mlp_neurons_per_token"]
    ratio = neurons["export"] / neurons["source"]
    if ratio <= PADDING_WARNING:
        return
    widths = [layer["shared_width"] + max(layer["expert_widths"], default=0) for layer in record["layers"]]
    widest = max(range(len(widths)), key=widths.__getitem__)
    print(f"warning: the {record['format']} layout runs {ratio:.2f}x the MLP neurons per token of the conversion: "
          f"the format gives every layer's experts one width, which the widest layer ({widest}: {widths[widest]:,} "
          "neurons per token) sets; --dense-layers auto writes such layers dense where the format holds dense "
          "layers of their own width", file=sys.stderr)


def _approximation_rows(approximation: dict) -> list[tuple[str, str]]:
    """One row per approximated part (what replaced it, its held-out agreement) and the perplexity change."""
    rows = []
    for name, part in approximation["parts"].items():
        rows.append((f"approximated: {name.replace('_', ' ')}",
                     f"{part['what']}; held-out agreement {part['held_out_agreement']:.3f}"))
        if name == "fitted_routers" and (deviation := max(x["max_weight_dev_from_1"] for x in part["layers"])):
            rows.append(("max |expert weight - 1|, held-out", f"{deviation:.2g} (top-k renormalised weights)"))
    rows.append((f"perplexity on {approximation['eval']['name']}", f"{approximation['source_ppl']:.3f} -> "
                 f"{approximation['export_ppl']:.3f} ({approximation['ppl_change']:+.3f})"))
    return rows


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _print_check(args.model)
    if args.format is None or args.out is None:
        raise ValueError("--format and --out are required (or --check to see which formats fit)")
    from moeify.api.export import export_folder, parse_dense_layers

    dense_layers = None if args.dense_layers is None else parse_dense_layers(args.dense_layers)
    record = export_folder(args.model, args.format, args.out, approximate=args.approximate, dense_layers=dense_layers,
                           distill_steps=args.distill_steps, calib=args.calib, eval=args.eval, seed=args.seed,
                           overwrite=args.overwrite, device=args.device, dtype=args.dtype, quant=args.quant)
    routed = sum(layer["routed"] for layer in record["layers"])
    rows = [("format", record["format"]),
            ("fidelity", "exact (up to fp rounding)" if record["exact"] else "APPROXIMATE (see the parts below)"),
            ("max |MLP difference|, float64", f"{record['max_abs_mlp_diff_float64']:.3g} (the mapping itself)"),
            *([("max |attention difference|, float64",
                f"{record['max_abs_attention_diff_float64']:.3g} (pruned head dims zero-padded in "
                f"{len(record['padded_attention_layers'])} layers: other float32 sums)")]
              if record["padded_attention_layers"] else []),
            ("max |logit difference|, float32", f"{record['max_abs_logit_diff']:.3g} on {record['probe']}"),
            ("float32 MLP sums", _float32_sums(record["rearranged_layers"])),
            ("routed / dense layers", f"{routed} / {len(record['layers']) - routed}"),
            ("params source -> export", f"{record['params']['source']:,} -> {record['params']['export']:,}"),
            ("MLP neurons per token", _neurons_row(record))]
    _warn_padding(record)
    if approximation := record.get("approximation"):
        rows += _approximation_rows(approximation)
        print("warning: the exported model approximates the converted one (--approximate)", file=sys.stderr)
    if written := record.get("gguf"):
        types = ", ".join(f"{count} {name}" for name, count in written["tensor_types"].items())
        rows += [("GGUF architecture (llama.cpp)", written["architecture"]),
                 ("GGUF file type", f"{written['file_type']} ({types} tensors)"),
                 ("GGUF tokenizer from", written["tokenizer"]), ("GGUF size", f"{written['bytes'] / 2**20:,.1f} MiB")]
    print_table(f"moeify export --format {args.format}" + (" (through " + record["format"] + ")" if written else ""),
                rows)
    if written:
        print(f"wrote {args.out} (runs in llama.cpp: llama-cli -m {args.out})")
    else:
        print(f"wrote {args.out}/ (loads with transformers.AutoModelForCausalLM.from_pretrained, no remote code)")
    return 0
