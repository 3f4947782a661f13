"""llama.cpp runs moeify's granitemoeshared export of SmolLM2 with the native model's greedy tokens.

llama.cpp computes qwen2_moe's shared-expert gate through silu(x) / x, NaN at the zero gate that makes
moeify's qwen2_moe export exact; granitemoeshared keeps the shared MLP always on with no gate, which is
how llama.cpp's own Granite code (src/models/granite.cpp) computes it. This converts the export to GGUF
with llama.cpp's own converter (float32), decodes 64 tokens greedily for the 8 prompts of
``serve_vllm.py`` with llama-cpp-python, and compares them with moeify's native model (where a sequence
parts, the native model's top-2 logit margin there says whether it was a near-tie). One JSON line per
format is appended to ``--out``; the qwen2_moe export is tried too (llama.cpp's converter may refuse it:
the row says why).

llama-cpp-python builds llama.cpp from source (PyPI has no wheel for this CPU); its source archive holds
the converter:

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llama && \\
        tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama
    pip install llama-cpp-python==0.3.36
    python benchmarks/serve_llamacpp.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp

The MoRE conversion and its exports are those of ``serve_vllm.py`` (made if absent, in ``--work``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from serve_vllm import EVAL, dense_folder, exported, prompts  # this folder is on sys.path when run

OUT = Path(__file__).resolve().parent / "results" / "serve_llamacpp.jsonl"
ROWS = ("more-granitemoeshared", "more")  # granitemoeshared, and qwen2_moe beside it


def to_gguf(converter: Path, folder: Path) -> Path:
    out = folder.with_suffix(".f32.gguf")
    if not out.is_file():
        done = subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "f32", "--outfile", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{converter.name} failed on {folder}:\n{done.stderr[-3000:]}")
    return out


def llama_tokens(gguf: Path, ids: list[list[int]], new_tokens: int) -> tuple[list[list[int]], bool]:
    """Greedy continuations by llama.cpp (EOS not special), and whether any logit was NaN."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=256, logits_all=True, verbose=False, seed=0)  # scores kept
    out, nan = [], False
    for prompt in ids:
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(new_tokens):
            logits = llm.scores[llm.n_tokens - 1]
            nan |= any(math.isnan(float(v)) for v in logits)
            token = int(logits.argmax())
            tokens.append(token)
            llm.eval([token])
        out.append(tokens)
    return out, nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree (its converter)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-serve"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    import moeify
    from moeify.evaluation.serving import compare_tokens, margins_at, native_tokens

    args.work.mkdir(parents=True, exist_ok=True)
    eval_text = args.work / "wikitext2_raw_test_first20000.txt"
    eval_text.write_text(EVAL.read_text()[:20000])
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    ids = prompts(AutoTokenizer.from_pretrained(dense_folder(args.work)))
    for row in ROWS:
        native, export = exported(row, args.work, eval_text)
        result: dict[str, Any] = {"row": row, "format": json.loads((export / "config.json").read_text())["model_type"],
                                  "engine": "llama.cpp (llama-cpp-python), f32 GGUF"}
        try:
            gguf = to_gguf(converter, export)
        except RuntimeError as error:  # the converter refuses the checkpoint: say why
            result["conversion_error"] = str(error).strip().splitlines()[-1]
        else:
            model = moeify.load_model(str(native), dtype="float32")[0]
            expected = native_tokens(model, ids, args.new_tokens)
            tokens, nan = llama_tokens(gguf, ids, args.new_tokens)
            result.update(nan_logits=nan, **compare_tokens(expected, tokens))
            result["native_margin_at_difference"] = margins_at(model, ids, expected, result["first_difference"])
        print(json.dumps(result), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
