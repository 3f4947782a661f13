"""Where vLLM's CPU time goes when it serves moeify's exports: the torch profiler around one bfloat16
generation of ``serve_vllm.py --speed``'s batch (32 prompts of 350 WikiText-2 test tokens + 64 generated),
the engine in this process, its operators' self time summed into the MoE kernel, the dense GEMMs, the
attention and everything else; and the MoE kernel alone against a dense MLP on the same tokens.

Run with the vLLM venv's python (``benchmarks/make_vllm_venv.sh``), after ``serve_vllm.py`` made the
exports:

    .venv-vllm/bin/python benchmarks/profile_vllm.py [--rows dense,tomoe,more,dsmoe] [--work /tmp/moeify-serve]

One JSON line per row is appended to ``results/profile_vllm.jsonl``; ``--markdown`` prints the table.
The kernel comparison (``kernel`` rows) times vLLM's ``cpu_fused_moe`` with one expert as wide as the dense
MLP, top-1 (the dense MLP's FLOPs exactly), against the dense MLP through ``torch.nn.functional.linear``
(oneDNN): the kernel's cost per FLOP; then the shapes the exports run: ToMoE's (8 experts, each 3/8 of the
width, top-1) and DSMoE's glm4_moe (8 experts of 1/8 of the width, top-5, beside the zero shared expert of
1/8 of the width that its format cannot leave out, a dense MLP).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where the profiler sees it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vllm import EXPORTS, SPEED_PROMPT_TOKENS, dense_folder, latest_rows, speed_prompts  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "profile_vllm.jsonl"
NEW_TOKENS = 64
# operator name (as the profiler reports it) -> the part of the model it computes
PARTS = {"_C::cpu_fused_moe": "moe_kernel", "_C::onednn_mm": "dense_gemm",
         "_C::cpu_attention_with_kv_cache": "attention"}
KERNEL_TOKENS = (2048, 32)  # a prefill chunk, a decode step of the batch
DSMOE_TOP_K = 5  # the top-k of the DSMoE export of SmolLM2 profiled in the README (of 8 experts)


def profile(folder: Path, ids: list[list[int]]) -> dict[str, Any]:
    """Self CPU seconds of one generation, by part."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=SPEED_PROMPT_TOKENS + NEW_TOKENS + 16, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in ids]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    began = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    parts = dict.fromkeys([*PARTS.values(), "other"], 0.0)
    for event in prof.key_averages():
        parts[PARTS.get(event.key, "other")] += event.self_cpu_time_total / 1e6
    return {"wall_seconds": round(seconds, 2), **{k: round(v, 3) for k, v in parts.items()}}


def kernel_rows(hidden: int, width: int) -> list[dict[str, Any]]:
    """vLLM's CPU MoE kernel against the dense MLP (oneDNN) on random bfloat16 tokens."""
    import torch
    from torch.nn import functional as F
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    isa = CPUUnquantizedExperts.isa  # the portable kernel: this CPU has no AMX tiles
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def dense(x: torch.Tensor, w: int):
        gate_up, down = randn(2 * w, hidden), randn(hidden, w)

        def run() -> None:
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, down)
        return run

    def moe(x: torch.Tensor, experts: int, w: int, k: int = 1):
        w13, w2 = cpu_prepack_moe_weight(randn(experts, 2 * w, hidden), isa), cpu_prepack_moe_weight(
            randn(experts, hidden, w), isa)
        ids = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(x.shape[0])])
        weights, out = torch.ones(x.shape[0], k), torch.empty_like(x)
        return lambda: cpu_fused_moe(out, x, w13, w2, None, None, weights, ids.to(torch.int32), "silu", isa)

    def timed(run, reps: int) -> float:
        run()
        began = time.perf_counter()
        for _ in range(reps):
            run()
        return (time.perf_counter() - began) / reps

    rows = []
    narrow, part = width * 3 // 8, width // 8
    for tokens in KERNEL_TOKENS:
        x, reps = randn(tokens, hidden) * 50, max(10, 40000 // tokens)
        times = {label: timed(run, reps) for label, run in (
            (f"dense MLP {width} (oneDNN)", dense(x, width)),
            (f"cpu_fused_moe 1 x {width}, top-1 (dense FLOPs)", moe(x, 1, width)),
            (f"dense MLP {narrow} (oneDNN)", dense(x, narrow)),
            (f"cpu_fused_moe 8 x {narrow}, top-1", moe(x, 8, narrow)),
            (f"dense MLP {part} (oneDNN)", dense(x, part)),
            (f"cpu_fused_moe 8 x {part}, top-{DSMOE_TOP_K}", moe(x, 8, part, DSMOE_TOP_K)))}
        base = next(iter(times.values()))
        rows += [{"row": f"kernel: {label}, {tokens} tokens", "isa": isa, "tokens": tokens,
                  "ms": round(seconds * 1e3, 3), "x_dense_mlp": round(seconds / base, 2)}
                 for label, seconds in times.items()]
    return rows


def markdown(path: Path) -> str:
    """The profile table and the kernel table of ``path``'s latest rows."""
    latest = latest_rows(path)
    lines = ["| row | wall s | MoE kernel s | dense GEMMs s | attention s | other s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['wall_seconds']:.2f} | {r['moe_kernel']:.2f} | {r['dense_gemm']:.2f} | "
              f"{r['attention']:.2f} | {r['other']:.2f} |" for r in latest if "wall_seconds" in r]
    lines += ["", "| kernel (ISA) | ms | x dense MLP |", "|---|---|---|"]
    lines += [f"| {r['row'].removeprefix('kernel: ')} ({r['isa']}) | {r['ms']:.3f} | {r['x_dense_mlp']:.2f} |"
              for r in latest if "isa" in r]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="dense,tomoe,more,dsmoe", help="dense and rows of serve_vllm.EXPORTS")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moeify-serve"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--markdown", action="store_true", help="print the table of --out and stop")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # one engine per process
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    from transformers import AutoConfig, AutoTokenizer

    dense = dense_folder(args.work)
    ids = speed_prompts(AutoTokenizer.from_pretrained(dense))
    if args.child is not None:
        print(json.dumps(profile(args.child, ids)))
        return
    rows = []
    for name in args.rows.split(","):
        if name == "dense":
            folder = dense
        else:
            method, options, fmt, _ = EXPORTS[name]
            folder = args.work / "-".join([method, *(f"{k}={v}" for k, v in options.items()), fmt])
            if not (folder / "config.json").is_file():
                raise SystemExit(f"{folder} is missing: run serve_vllm.py --rows {name} first")
        child = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--child", str(folder)],
                               capture_output=True, text=True, check=True)
        rows.append({"row": name, "served": str(folder), **json.loads(child.stdout.strip().splitlines()[-1])})
    config = AutoConfig.from_pretrained(dense)
    rows += kernel_rows(config.hidden_size, config.intermediate_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
