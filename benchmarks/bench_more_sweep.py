"""MoRE's two numbers the paper does not give, act_ratio (rho_act) and alpha (Eq. 9), swept on calibration
data only.

The paper fixes neither: its App. D.2 uses k_act = 7 and 14 of 14,336 channels, and Eq. 9's alpha has no
value. moeify's defaults (act_ratio 0.05, alpha 0) are chosen here. WikiText-2 valid is split in two
halves by paragraphs: MoRE calibrates on the first, and each setting is scored by perplexity on the
second (2048-token windows, or the model's context if shorter; the first ``--select-chars`` characters); the evaluation text (WikiText-2
test) is never read. Every run converts the same dense model (SmolLM2-135M, the GGUF in ../shared/assets,
by default) at the default PR 0.2, so the activated parameters are the same for every setting. One JSON
line per setting, appended to ``--out``, then the best; ``--markdown`` prints the grid of ``--out`` (the
best setting in bold).

    python benchmarks/bench_more_sweep.py [--act-ratios 0.02,0.05,0.1,0.2] [--alphas 0,0.5,1]
        [--model GGUF_OR_FOLDER] [--select-chars 60000] [--out FILE.jsonl]
    python benchmarks/bench_more_sweep.py --markdown
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
from bench_real import CALIB, MODEL  # this folder is on sys.path when run
from results_file import append_row, read_rows

from moeify.calibration.data import TextSource, read_text
from moeify.evaluation.perplexity import perplexity
from moeify.loading import load_model
from moeify.methods import ConversionContext, get_method
from moeify.moe.accounting import activated_parameters
from moeify.options import build_config


def halves(source: TextSource) -> tuple[TextSource, TextSource]:
    """The text split at the paragraph boundary nearest its middle: (calibration, selection)."""
    middle = source.text.find("\n\n", len(source.text) // 2)
    middle = len(source.text) // 2 if middle < 0 else middle
    return (TextSource(f"{source.name}[first half]", source.text[:middle]),
            TextSource(f"{source.name}[second half]", source.text[middle:]))


def markdown(rows: list[dict[str, Any]]) -> str:
    """Selection perplexity by act_ratio (rows) and alpha (columns); the lowest in bold, a blank: not run."""
    alphas = sorted({row["alpha"] for row in rows})
    grid = {(row["act_ratio"], row["alpha"]): row["selection_ppl"] for row in rows}
    best = min(grid, key=grid.__getitem__)
    lines = ["| act_ratio \\ alpha | " + " | ".join(f"{a:g}" for a in alphas) + " |", "|---|" + "---|" * len(alphas)]
    for act_ratio in sorted({row["act_ratio"] for row in rows}):
        cells = [("" if (act_ratio, a) not in grid else
                  f"**{grid[act_ratio, a]:.2f}**" if (act_ratio, a) == best else f"{grid[act_ratio, a]:.2f}")
                 for a in alphas]
        lines.append(f"| {act_ratio:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--act-ratios", default="0.02,0.05,0.1,0.2")
    parser.add_argument("--alphas", default="0,0.5,1")
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--select-chars", type=int, default=60_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "more_sweep.jsonl")
    parser.add_argument("--markdown", action="store_true", help="print the grid of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(read_rows(args.out)), end="")
        return
    calib, rest = halves(read_text(CALIB))
    select = TextSource(rest.name + f"[:{args.select_chars}]", rest.text[:args.select_chars])
    dense, tokenizer = load_model(args.model)
    method = get_method("more")
    seq_len = min(2048, dense.config.max_position_embeddings)
    rows = []
    for act_ratio in map(float, args.act_ratios.split(",")):
        for alpha in map(float, args.alphas.split(",")):
            model = copy.deepcopy(dense)
            ctx = ConversionContext(model, tokenizer, calib, 0, torch.device("cpu"), progress=False)
            start = time.perf_counter()
            method.run(ctx, build_config(method.config_cls, {"act_ratio": act_ratio, "alpha": alpha}))
            convert_s = time.perf_counter() - start
            ppl = perplexity(model.eval(), tokenizer, select, seq_len).ppl
            rows.append({"act_ratio": act_ratio, "alpha": alpha, "selection_ppl": round(ppl, 3),
                         "apr": round(activated_parameters(model).apr, 4), "convert_s": round(convert_s, 1)})
            append_row(args.out, rows[-1])
            del model, ctx
    best = min(rows, key=lambda row: row["selection_ppl"])
    print(json.dumps({"best": best, "calibration": calib.name, "selection": select.name}))


if __name__ == "__main__":
    main()
