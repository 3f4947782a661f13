"""How far a converted model's perplexity moves under perturbations far below bfloat16's rounding: the floor
under which a bfloat16-vs-float32 gap (``bench_bf16.py``) says nothing about the working dtype.

Each method converts SmolLM2 (the bfloat16 checkpoint ``bench_bf16.py`` makes) once in float32 (the
training methods at ``bench_bf16.py``'s CPU budgets); its perplexity on a prefix of WikiText-2 raw test is
then measured plainly and with every decoder-layer projection's input multiplied by (1 + eps u), u uniform
in [-1, 1] drawn afresh per entry (``--seeds`` draws per eps). eps = 2^-9 is bfloat16's rounding (half an
8-bit mantissa step), 2^-20 sixteen float32 ulps. A model whose perplexity is a smooth function of its
inputs moves by about eps; hard decisions (TEAL's input thresholds, routers choosing experts) turn an input
crossing a decision boundary into an O(1) change of the next layer's input, so the perturbation cascades.
Prints one JSON line per method (``dense``: the checkpoint itself), appended to ``--out``.

    python benchmarks/bench_precision_floor.py [--methods dense,cmoe,teal,random_split] [--seeds 3]
    python benchmarks/bench_precision_floor.py --markdown
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from bench_bf16 import OPTIONS, arguments, bf16_checkpoint, eval_prefix, report  # this folder is on sys.path when run

if TYPE_CHECKING:
    import torch
    from torch import nn

EPSILONS = {"2^-20": 2.0 ** -20, "2^-9": 2.0 ** -9}
MEANING = {"2^-20": "16 float32 ulps", "2^-9": "bfloat16's rounding"}


def perturbed_inputs(model: nn.Module, eps: float, generator: torch.Generator) -> list:
    """Forward pre-hooks multiplying every decoder projection's input by (1 + eps u); returns the handles."""
    import torch
    from torch import nn

    def hook(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        u = torch.rand(x.shape, generator=generator, dtype=torch.float32) * 2 - 1
        return (x * (1 + eps * u).to(x.dtype), *args[1:])
    return [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in name]


def floor_row(method: str, checkpoint: Path, eval_file: Path, seeds: int) -> dict:
    """``method``'s float32 conversion (``dense``: the checkpoint), its perplexity and its relative moves."""
    import torch
    from bench_real import CALIB

    import moeify
    from moeify.calibration.data import read_text
    from moeify.evaluation.perplexity import perplexity
    from moeify.loading import load_model

    if method == "dense":
        model, tokenizer = load_model(checkpoint, dtype="float32")
    else:
        result = moeify.convert(checkpoint, method, OPTIONS.get(method), calib=CALIB, eval=eval_file,
                                dtype="float32", eval_seq_len=512, measure_speed=False)
        model, tokenizer = result.model, result.tokenizer
    eval_text = read_text(eval_file)
    base = perplexity(model, tokenizer, eval_text, 512).ppl
    moves: dict[str, list[float]] = {}
    for label, eps in EPSILONS.items():
        moves[label] = []
        for seed in range(seeds):
            handles = perturbed_inputs(model, eps, torch.Generator().manual_seed(seed))
            moves[label].append(round(perplexity(model, tokenizer, eval_text, 512).ppl / base - 1, 4))
            for handle in handles:
                handle.remove()
    return {"method": method, "options": OPTIONS.get(method, {}),
            "model": "SmolLM2-135M bfloat16 checkpoint, converted and run in float32",
            "eval": eval_file.name, "ppl": base, "relative_moves": moves,
            "max_abs_move": {label: max(abs(m) for m in values) for label, values in moves.items()}}


def _move(value: float) -> str:
    return f"{100 * value + 0.0:+.2f}"  # + 0.0: no "-0.00"


def markdown(path: Path) -> str:
    """The table of every line of ``path``: the float32 perplexity and, per eps, the largest relative move
    over the draws (the moves of each draw beside bfloat16's)."""
    labels = list(EPSILONS)
    lines = ["| method | float32 | " + " | ".join(f"largest move, eps = {label} ({MEANING[label]})" for label in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for line in path.read_text().splitlines():
        row = json.loads(line)
        options = ", ".join(f"{key}={value}" for key, value in (row.get("options") or {}).items()
                            if key != "checkpoint_every")
        cells = [f"{100 * row['max_abs_move'][label]:.2f} %" for label in labels]
        cells[-1] += f" ({', '.join(_move(m) for m in row['relative_moves'][labels[-1]])} %)"
        lines.append(f"| {row['method']}{f' ({options})' if options else ''} | {row['ppl']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = arguments(__doc__, "dense,cmoe,teal,random_split", "bench_precision_floor.jsonl")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    checkpoint = bf16_checkpoint(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        eval_file = eval_prefix(Path(tmp), args.eval_chars)
        for method in args.methods.split(","):
            report(floor_row(method, checkpoint, eval_file, args.seeds), args.out)


if __name__ == "__main__":
    main()
