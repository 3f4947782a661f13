"""Greedy tokens from vLLM beside moeify's own, so that a served export is checked against the model it
came from.

``served_tokens`` runs vLLM (whichever build is installed: its CPU build runs here) in a child process,
``python -m moeify.evaluation.serving``: vLLM starts engine processes of its own, which want a guarded
main module, and a finished child gives all its memory back. Prompts go in as token ids (no tokenizer
involved), decoding is greedy with the end-of-sequence token ignored, in eager mode (no graph capture:
the kernels vLLM would run anyway). ``native_tokens`` decodes the same way with moeify's native model;
``compare_tokens`` says which sequences agree and where the first one that does not parts, ``margins_at``
how close the native model's top two logits were there (a tie another engine's rounding may break).
``forced_logits`` and ``forced_agreement`` compare an engine's logits with the native model's on the native
greedy sequences themselves (teacher forcing), so one broken tie does not hide the rest of a sequence.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

KV_CACHE_GIB = "1"  # vLLM CPU's KV cache (VLLM_CPU_KVCACHE_SPACE); the checks use short sequences


def served_tokens(folder: str | Path, prompts: list[list[int]], new_tokens: int, dtype: str = "float32",
                  max_model_len: int = 1024, timeout: float = 1800) -> dict[str, Any]:
    """{"tokens": the generated ids per prompt, "seconds": generation wall time, "tokens_per_s": prompt
    and generated tokens per second} from vLLM serving ``folder``."""
    with tempfile.TemporaryDirectory() as tmp:
        request, answer = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        request.write_text(json.dumps({"folder": str(folder), "prompts": prompts, "new_tokens": new_tokens,
                                       "dtype": dtype, "max_model_len": max_model_len}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)}
        done = subprocess.run([sys.executable, "-m", "moeify.evaluation.serving", str(request), str(answer)],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            cause = root_cause(done.stdout + done.stderr)  # vLLM logs its processes' errors to stdout
            raise RuntimeError(f"vLLM failed on {folder}: {cause}\n{done.stderr[-4000:]}")
        return json.loads(answer.read_text())


def root_cause(output: str) -> str:
    """The first exception line in a failed vLLM run's ``output``, plain or logged as an ERROR by one of its
    processes (the worker reports the cause before the client's generic EngineDeadError), or its last line."""
    logged = r"\[rank\d+\]: |\(.*?\) ERROR .*?\] "  # how vLLM's processes prefix what they log
    causes = [m.group(1) for m in re.finditer(rf"^(?:{logged})?((?:\w+\.)*\w*(?:Error|Exception): .*)$", output,
                                              flags=re.MULTILINE)]
    causes = [c for c in causes if "EngineDeadError" not in c] or causes
    return causes[0] if causes else (output.strip().splitlines() or ["no output"])[-1]


def cache_keyword(model: nn.Module) -> str:
    """The keyword that hands ``model`` its KV cache back: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def native_tokens(model: nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by ``model``, one prompt at a time (no padding) with the KV
    cache; the end-of-sequence token is a token like any other, as in vLLM with ``ignore_eos``
    (transformers' ``min_new_tokens`` would forbid it instead)."""
    device, keyword = next(model.parameters()).device, cache_keyword(model)
    out = []
    for prompt in prompts:
        step = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        tokens = [int(step.logits[0, -1].argmax())]
        for _ in range(new_tokens - 1):
            step = model(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                         **{keyword: step.past_key_values})
            tokens.append(int(step.logits[0, -1].argmax()))
        out.append(tokens)
    return out


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first position where ``got`` parts from ``expected`` (a shorter one parts where it ends), or None."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_tokens(expected: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """How many sequences are identical, where each first parts (None: never), and the share of equal tokens."""
    parts = [first_difference(e, g) for e, g in zip(expected, got)]
    equal = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    return {"identical_sequences": sum(p is None for p in parts), "sequences": len(parts),
            "first_difference": parts, "token_agreement": equal / max(1, sum(len(e) for e in expected))}


@torch.no_grad()
def margins_at(model: nn.Module, prompts: list[list[int]], expected: list[list[int]],
               positions: list[int | None]) -> list[float | None]:
    """The native model's top-1 minus top-2 logit where each sequence first parts (None where it does
    not): a near-zero margin is a tie another engine's float rounding may break the other way."""
    device = next(model.parameters()).device
    out: list[float | None] = []
    for prompt, tokens, at in zip(prompts, expected, positions):
        if at is None:
            out.append(None)
            continue
        logits = model(input_ids=torch.tensor([prompt + tokens[:at]], device=device)).logits[0, -1].float()
        top = logits.topk(2).values
        out.append(float(top[0] - top[1]))
    return out


@torch.no_grad()
def forced_logits(model: nn.Module, prompt: list[int], tokens: list[int]) -> Tensor:
    """(len(tokens), vocab) float32 CPU: the logits that predict each of ``tokens`` after ``prompt`` and the
    tokens before it, in one forward pass (teacher forcing)."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    return model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().cpu()


def forced_agreement(expected: list[list[int]], native: list[Tensor], engine: list[Tensor]) -> dict[str, Any]:
    """An engine's teacher-forced logits (``engine``, one (tokens, vocab) tensor per sequence) against the
    native model's (``native``) on the native greedy ``expected`` tokens: the largest logit difference and
    where it is ([sequence, position]), the median over positions of each position's largest difference,
    how many positions' argmax is not the native token, and the native top-2 margin at the widest of those
    (a near-tie: the engines' float rounding breaks it either way)."""
    per_position, parted, margins = [], 0, []
    for tokens, ours, theirs in zip(expected, native, engine):
        per_position.append((ours - theirs).abs().max(dim=-1).values)
        wrong = theirs.argmax(dim=-1) != torch.tensor(tokens)
        top = ours.topk(2, dim=-1).values
        parted += int(wrong.sum())
        margins += (top[:, 0] - top[:, 1])[wrong].tolist()
    largest = max(range(len(per_position)), key=lambda i: float(per_position[i].max()))
    return {"forced_positions": sum(len(t) for t in expected),
            "max_abs_logit_diff": float(per_position[largest].max()),
            "max_abs_logit_diff_at": [largest, int(per_position[largest].argmax())],
            "median_position_logit_diff": float(torch.cat(per_position).median()),
            "argmax_differences": parted, "largest_native_margin_at_a_difference": max(margins, default=None)}


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["folder"], dtype=request["dtype"], enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=request["max_model_len"], seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=request["new_tokens"], ignore_eos=True,
                            detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    began = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    total = sum(len(p) for p in request["prompts"]) + sum(len(t) for t in tokens)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": total / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description="serve one request file with vLLM (see served_tokens)")
    parser.add_argument("request", type=Path)
    parser.add_argument("answer", type=Path)
    args = parser.parse_args()
    args.answer.write_text(json.dumps(_serve(json.loads(args.request.read_text()))))


if __name__ == "__main__":
    main()
