"""``moeify analyze``: inter-layer similarity of a model (Dense2MoE §2.2), matrices + heatmaps + record."""

from __future__ import annotations

import argparse
from pathlib import Path

from moeify.cli.common import add_device_arguments
from moeify.cli.format import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "analyze", help="inter-layer similarity of a model (Dense2MoE Fig. 3)",
        description="Cosine similarity of every pair of decoder-layer outputs (S_L) and of MLP inputs (S_M), "
                    "averaged over calibration tokens and gathered one decoder layer at a time; writes "
                    "layer_similarity.json, two heatmap PNGs and record.json into --out (atomically).")
    parser.add_argument("model", nargs="?", default=None, help="local path or hub name (default: embedded)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (created atomically)")
    parser.add_argument("--calib", default=None, help="calibration text (default: embedded TinyStories slice)")
    parser.add_argument("--samples", type=int, default=8, help="calibration windows (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: min(1024, context))")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the window choice (default 0)")
    add_device_arguments(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moeify.api import analyze_layers, save_analysis
    from moeify.files import check_output_dir

    check_output_dir(args.out, args.overwrite)
    result = analyze_layers(args.model, calib=args.calib, samples=args.samples, seq_len=args.seq_len,
                            seed=args.seed, device=args.device, dtype=args.dtype, progress=True)
    out = save_analysis(result, args.out, overwrite=args.overwrite)
    rec = result.record
    rows = [("decoder layers", str(len(rec["similarity"]["layer_output"]))),
            ("calibration tokens", str(rec["similarity"]["tokens"]))]
    rows += [(f"span: keep {s['layer']}, remove {s['removed']}",
              f"S_L {s['layer_output_similarity']:.3f}, MLP-input distance {s['mlp_input_distance']:.3f}")
             for s in rec["spans"][:5]]
    print_table(f"moeify analyze {rec['model']}", rows)
    print(f"wrote {out}/ ({', '.join(rec['artifacts'])}, record.json)")
    return 0
