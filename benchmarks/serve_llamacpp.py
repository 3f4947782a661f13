"""llama.cpp runs moeify's granitemoeshared export of SmolLM2 with the native model's greedy tokens.

llama.cpp computes qwen2_moe's shared-expert gate through silu(x) / x, NaN at the zero gate that makes
moeify's qwen2_moe export exact; granitemoeshared keeps the shared MLP always on with no gate, which is
how llama.cpp's own Granite code (src/models/granite.cpp) computes it. This converts the export to GGUF
with llama.cpp's own converter (float32), decodes 64 tokens greedily for the 8 prompts of
``serve_vllm.py`` with llama-cpp-python, and compares them with moeify's native model (where a sequence
parts, the native model's top-2 logit margin there says whether it was a near-tie). Then, teacher-forced
on the native greedy sequences, llama.cpp's logits at every position against the native model's: the
largest difference, the positions whose argmax is not the native token and the native margin there, and,
for a routed model, the smallest routing-score gap at the largest difference's position (a routing
near-tie that the engine's rounding breaks the other way moves more than a tie of the output). The
dense SmolLM2 goes through the same steps first: what llama.cpp's float32 arithmetic does to the model
it was converted from is the yardstick for the export's rows. One JSON line per row is appended to
``--out``; the qwen2_moe export is tried too (llama.cpp's converter may refuse it: the row says why).

llama-cpp-python builds llama.cpp from source (PyPI has no wheel for this CPU); its source archive holds
the converter:

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llama && \\
        tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install /tmp/llama/llama_cpp_python-0.3.36.tar.gz
    python benchmarks/serve_llamacpp.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
    python benchmarks/serve_llamacpp.py --markdown    # the table of --out

The MoRE conversion and its exports are those of ``serve_vllm.py`` (made if absent, in ``--work``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn

OUT = Path(__file__).resolve().parent / "results" / "serve_llamacpp.jsonl"
ROWS = ("dense", "more-granitemoeshared", "more")  # the engine on the dense model; granitemoeshared; qwen2_moe


def to_gguf(converter: Path, folder: Path) -> Path:
    out = folder.with_suffix(".f32.gguf")
    if not out.is_file():
        done = subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "f32", "--outfile", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{converter.name} failed on {folder}:\n{done.stderr[-3000:]}")
    return out


def llama_runs(gguf: Path, ids: list[list[int]],
               expected: list[list[int]]) -> tuple[list[list[int]], list[Tensor], bool]:
    """llama.cpp's greedy continuations of ``ids`` as long as ``expected``'s (EOS not special), its
    teacher-forced logits on the ``expected`` tokens, and whether any logit was NaN."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=256, logits_all=True, verbose=False, seed=0)  # scores kept
    greedy, forced, nan = [], [], False
    for prompt, tokens in zip(ids, expected):
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in tokens:
            logits = llm.scores[llm.n_tokens - 1]
            nan |= bool(np.isnan(logits).any())
            out.append(int(logits.argmax()))
            llm.eval([out[-1]])
        greedy.append(out)
        llm.reset()
        llm.eval(prompt + tokens)
        scores = np.array(llm.scores[len(prompt) - 1:len(prompt) + len(tokens) - 1])
        nan |= bool(np.isnan(scores).any())
        forced.append(torch.from_numpy(scores))
    return greedy, forced, nan


def routing_gaps(model: nn.Module, prompt: list[int], tokens: list[int], position: int) -> dict[str, float] | None:
    """Over the native model's routed layers, the smallest gap between the k-th and the (k+1)-th routing
    score of the export's linear routers (x @ W.T) at ``position`` of the forced sequence, and the median of
    that smallest gap over the sequence's positions; None for a model without linear routers. A gap near
    zero is a routing choice that float rounding may make either way: the engine then runs another expert
    for that token, and the difference spreads to the positions after it through attention."""
    import torch

    from moeify.calibration.hooks import observing
    from moeify.runtime.moe import MoeMLP
    from moeify.runtime.routers import NotLinear

    routers = [m.router for m in model.modules() if isinstance(m, MoeMLP) and m.router is not None]
    if not routers:
        return None
    try:
        forms = [router.linear_form() for router in routers]
    except NotLinear:
        return None
    inputs: list[Tensor] = []  # in forward order: the routers' order
    with torch.no_grad(), observing({router: lambda x, _out: inputs.append(x) for router in routers}):
        model(input_ids=torch.tensor([prompt + tokens]))
    gaps = []
    for form, x in zip(forms, inputs):
        top = (x.reshape(-1, x.shape[-1]).double() @ form.weight.T).topk(form.top_k + 1, dim=-1).values
        gaps.append(top[:, form.top_k - 1] - top[:, form.top_k])
    smallest = torch.stack(gaps).min(dim=0).values[len(prompt) - 1:-1]  # the positions that predict ``tokens``
    return {"router_gap_at_largest_difference": float(smallest[position]),
            "median_router_gap": float(smallest.median())}


def markdown(path: Path) -> str:
    """The table of ``path``'s latest line per row (in ``ROWS``' order): llama.cpp's greedy sequences and teacher-forced logits
    against the native model's, or why llama.cpp's converter refused the export."""
    latest: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        latest[row["row"]] = row
    lines = [("| row | format | identical greedy sequences | teacher-forced: argmax differences / positions | "
              "largest logit difference | median per position | NaN |"), "|---|---|---|---|---|---|---|"]
    for name, row in sorted(latest.items(), key=lambda item: ROWS.index(item[0]) if item[0] in ROWS else len(ROWS)):
        if "conversion_error" in row:
            lines.append(f"| {name} | {row['format']} | not converted: {row['conversion_error']} | - | - | - | - |")
            continue
        forced = (f"{row['argmax_differences']} / {row['forced_positions']}" if "forced_positions" in row else "-")
        largest = f"{row['max_abs_logit_diff']:.3f}" if "max_abs_logit_diff" in row else "-"
        median = f"{row['median_position_logit_diff']:.4f}" if "median_position_logit_diff" in row else "-"
        lines.append(f"| {name} | {row['format']} | {row['identical_sequences']}/{row['sequences']} | {forced} | "
                     f"{largest} | {median} | {'yes' if row['nan_logits'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree (its converter); required to measure")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-serve"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    if args.llama_cpp is None:
        parser.error("--llama-cpp is required (unless --markdown)")
    from serve_vllm import EVAL, dense_folder, exported, prompts  # this folder is on sys.path when run
    from transformers import AutoTokenizer

    import moeify
    from moeify.evaluation.serving import compare_tokens, forced_agreement, forced_logits, margins_at, native_tokens

    args.work.mkdir(parents=True, exist_ok=True)
    eval_text = args.work / "wikitext2_raw_test_first20000.txt"
    eval_text.write_text(EVAL.read_text()[:20000])
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    dense = dense_folder(args.work)
    ids = prompts(AutoTokenizer.from_pretrained(dense))
    for row in ROWS:
        native, export = (dense, dense) if row == "dense" else exported(row, args.work, eval_text)
        result: dict[str, Any] = {"row": row, "format": json.loads((export / "config.json").read_text())["model_type"],
                                  "engine": "llama.cpp (llama-cpp-python), f32 GGUF"}
        try:
            gguf = to_gguf(converter, export)
        except RuntimeError as error:  # the converter refuses the checkpoint: say why
            result["conversion_error"] = str(error).strip().splitlines()[-1]
        else:
            model = moeify.load_model(str(native), dtype="float32")[0]
            expected = native_tokens(model, ids, args.new_tokens)
            tokens, forced, nan = llama_runs(gguf, ids, expected)
            result.update(nan_logits=nan, **compare_tokens(expected, tokens))
            result["native_margin_at_difference"] = margins_at(model, ids, expected, result["first_difference"])
            native_logits = [forced_logits(model, p, t) for p, t in zip(ids, expected)]
            result.update(forced_agreement(expected, native_logits, forced))
            sequence, position = result["max_abs_logit_diff_at"]
            result["routing"] = routing_gaps(model, ids[sequence], expected[sequence], position)
        print(json.dumps(result), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
