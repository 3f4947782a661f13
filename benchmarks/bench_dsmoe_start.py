"""How many tokens DSMoE's margin start must be fitted on for its gates to start on for text it never saw.

``gate_init=margin`` fits each layer's Y by least squares to x Y = 1 over the tokens it is given (a decoder
layer at a time, the layers before already fitted). With few tokens the fit follows those tokens and not the
direction MLP inputs share, and on other text some tokens start with a layer's experts off (x Y <= 0). This
partitions SmolLM2-135M (the GGUF in ../shared/assets, d = 576) as DSMoE does, fits the gates on N tokens of
WikiText-2 valid (the training text) for each N, and reports the start logits x Y of held-out text (the
first 8 x 256 tokens of WikiText-2 raw test): the lowest over every layer and token, and the largest share
of tokens at or below 0 in any layer. The conversion's own fit takes max(batch, ``FIT_TOKENS_PER_DIM`` x d)
tokens. One JSON line per N, appended to ``--out``; ``--markdown`` prints the table of ``--out``.

    python benchmarks/bench_dsmoe_start.py [--tokens 256,1024,2048,2304] [--out FILE.jsonl]
    python benchmarks/bench_dsmoe_start.py --markdown
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch
from bench_real import CALIB, EVAL, MODEL  # this folder is on sys.path when run
from results_file import append_row, read_rows

from moeify.calibration.data import TextSource, read_text, token_stream
from moeify.loading import load_model
from moeify.methods.base import ConversionContext
from moeify.methods.dsmoe import DsmoeConfig
from moeify.methods.dsmoe.config import FIT_TOKENS_PER_DIM
from moeify.methods.dsmoe.convert import partition_model_
from moeify.methods.dsmoe.train import margin_gates_
from moeify.options import build_config
from moeify.training.loop import random_windows

SEQ_LEN = 256


def held_out_logits(ctx: ConversionContext, held_out: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's start logits x Y on the tokens of ``held_out`` (every expert of a layer has the same Y)."""
    layers = [ctx.adapter.mlp_module(i) for i in range(ctx.adapter.num_layers)]
    logits: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: logits.append(m.router.proj(args[0])[..., 0].flatten()))
             for layer in layers]
    with torch.no_grad():
        ctx.model(held_out)
    for hook in hooks:
        hook.remove()
    return logits


def fit_row(model: torch.nn.Module, tokenizer, calib: TextSource, stream: torch.Tensor, tokens: int,
            held_out: torch.Tensor) -> dict:
    ctx = ConversionContext(copy.deepcopy(model), tokenizer, calib, 0, torch.device("cpu"), progress=False)
    partition_model_(ctx, build_config(DsmoeConfig, {}))
    layers = [ctx.adapter.mlp_module(i) for i in range(ctx.adapter.num_layers)]
    windows = random_windows(stream, SEQ_LEN, tokens // SEQ_LEN, torch.Generator().manual_seed(1))
    fitted_lowest = margin_gates_(ctx, layers, windows, 1.0, batch_size=8)
    logits = held_out_logits(ctx, held_out)
    d = model.config.hidden_size
    return {"fit_tokens": windows.numel(), "fit_tokens_per_d": round(windows.numel() / d, 2),
            "fitted_lowest_logit": round(fitted_lowest, 4), "held_out_tokens": held_out.numel(),
            "held_out_lowest_logit": round(min(float(x.min()) for x in logits), 4),
            "held_out_max_share_off": round(max(float((x <= 0).double().mean()) for x in logits), 4)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| fit tokens | lowest start logit, fitted tokens | lowest, held out | held-out tokens starting off, "
             "worst layer |", "|---|---|---|---|"]
    for row in rows:
        default = ", the default here" if row["fit_tokens_per_d"] == FIT_TOKENS_PER_DIM else ""
        lines.append(f"| {row['fit_tokens']:,} ({row['fit_tokens_per_d']:g} d{default}) | "
                     f"{row['fitted_lowest_logit']:.2f} | {row['held_out_lowest_logit']:.2f} | "
                     f"{100 * row['held_out_max_share_off']:.1f} % |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,1024,2048,2304", help="fit token counts (multiples of 256)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_dsmoe_start.jsonl")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(read_rows(args.out)), end="")
        return
    model, tokenizer = load_model(MODEL, dtype="float32")
    test = tokenizer(EVAL.read_text()[:40_000], return_tensors="pt").input_ids[0]
    held_out = test[:8 * SEQ_LEN].reshape(8, SEQ_LEN)
    print(f"the conversion fits on max(batch, {FIT_TOKENS_PER_DIM} d) = "
          f"{FIT_TOKENS_PER_DIM * model.config.hidden_size} tokens or more")
    calib = read_text(CALIB)
    stream = token_stream(calib, tokenizer)  # tokenised once for every N
    for tokens in (int(t) for t in args.tokens.split(",")):
        append_row(args.out, fit_row(model, tokenizer, calib, stream, tokens, held_out))


if __name__ == "__main__":
    main()
