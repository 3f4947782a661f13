"""Dense vs MoE speed in one process (what ``moeify bench`` prints and adds to a run's record): prefill at
several (batch, length) shapes and greedy decoding with the KV cache at several batch sizes, each the median
of timed repeats after a warm-up with its spread, both models eager or both compiled alike."""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moeify.evaluation.speed import decode_speed, forward_speed, macs_per_token
from moeify.moe.accounting import tracking_routing
from moeify.runtime.packed import COMPILED_GROUPED_MM_DTYPES

# warm-up passes of a compiled model: the first compiles the shape, the next ones record its CUDA graphs
COMPILED_WARMUP = 3


def compile_mode(device: torch.device) -> str:
    """torch.compile's mode: CUDA graphs on a GPU (the fixed shapes of a benchmark allow them; without them
    a small batch is launch-bound), the default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def compiled_forward(model: nn.Module) -> nn.Module:
    """``model`` compiled as one graph per shape (``fullgraph``: a graph break is an error, not a slow
    path). Call it after one eager forward of ``model``: that builds the MoE layers' packed experts, which
    a graph reads as they are."""
    device = next(model.parameters()).device
    return torch.compile(model, fullgraph=True, dynamic=False, mode=compile_mode(device))


def compiled_generation(model: nn.Module) -> dict[str, Any]:
    """``generate`` arguments that compile the decode step alike (transformers' static KV cache and its
    compile config; on a CPU transformers compiles only when told to compile on every device)."""
    from transformers import CompileConfig

    device = next(model.parameters()).device
    config = CompileConfig(fullgraph=True, dynamic=False, mode=compile_mode(device))
    config._compile_all_devices = device.type != "cuda"  # transformers' own switch; it compiles on GPUs anyway
    return {"cache_implementation": "static", "compile_config": config}


def check_shapes(model: nn.Module, prefill: list[tuple[int, int]], prompt_len: int, new_tokens: int) -> None:
    """Every shape fits the model's positions (before any timing)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return
    for batch, tokens in prefill:
        if tokens > limit:
            raise ValueError(f"prefill {batch}x{tokens} is longer than the model's {limit} positions; "
                             f"allowed: up to {limit} tokens")
    if prompt_len + new_tokens > limit:
        raise ValueError(f"decoding {new_tokens} tokens after a {prompt_len}-token prompt exceeds the model's "
                         f"{limit} positions")


def _pair(dense: tuple[float, float], moe: tuple[float, float], **shape: int) -> dict[str, Any]:
    return {**shape, "dense": dense[0], "moe": moe[0], "speedup": moe[0] / dense[0],
            "spread": {"dense": dense[1], "moe": moe[1]}}


def benchmark_pair(dense: nn.Module, moe: nn.Module, prefill: list[tuple[int, int]], decode_batch_sizes: list[int],
                   prompt_len: int, new_tokens: int, repeats: int, compile: bool = False,
                   measured: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Prefill tokens/s per (batch, tokens) shape and decode tokens/s per batch size of both models, each
    shape dense then MoE, the ideal speed-up from multiply-accumulate counts, and the peak memory.
    ``compile``: both models run through ``torch.compile`` (``compiled_forward``, ``compiled_generation``).
    ``measured`` receives the rows so far after each shape (``{"prefill": [...], "decode": [...]}``), so a
    run cut short (compiling a large model can outlast a time limit) keeps the shapes it finished."""
    device = next(moe.parameters()).device
    check_shapes(moe, prefill, prompt_len, new_tokens)
    if compile and (dtype := next(moe.parameters()).dtype) not in COMPILED_GROUPED_MM_DTYPES:
        raise ValueError(f"compiling needs the models in bfloat16 (--dtype bfloat16), not {str(dtype)[6:]}: torch "
                         "compiles the experts' grouped matmul in bfloat16 only")
    models = {"dense": dense, "moe": moe}
    runners: dict[str, nn.Module | None] = dict.fromkeys(models)
    generation: dict[str, dict[str, Any] | None] = dict.fromkeys(models)
    warmup = 2
    if compile:
        with torch.no_grad():  # the eager forward that builds the packed experts a graph reads
            moe(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device), use_cache=False)
        runners = {name: compiled_forward(model) for name, model in models.items()}
        generation = {name: compiled_generation(model) for name, model in models.items()}
        warmup = COMPILED_WARMUP
    prefill_rows: list[dict[str, Any]] = []
    decode_rows: list[dict[str, Any]] = []

    def shape_done() -> None:  # hands the rows so far to ``measured``
        if measured is not None:
            measured({"prefill": prefill_rows, "decode": decode_rows, "compiled": compile})

    for batch, tokens in prefill:
        speeds = {name: forward_speed(model, batch, tokens, repeats=repeats, warmup=warmup, runner=runners[name])
                  for name, model in models.items()}
        prefill_rows.append(_pair(speeds["dense"], speeds["moe"], batch_size=batch, seq_len=tokens))
        shape_done()
    for batch in decode_batch_sizes:
        speeds = {name: decode_speed(model, batch, prompt_len, new_tokens, repeats=max(1, repeats // 2),
                                     warmup=warmup - 1, compiled=generation[name]) for name, model in models.items()}
        decode_rows.append(_pair(speeds["dense"], speeds["moe"], batch_size=batch, prompt_len=prompt_len,
                                 new_tokens=new_tokens))
        shape_done()
    return {"prefill": prefill_rows, "decode": decode_rows,
            "ideal_speedup": macs_per_token(dense, prompt_len) / _moe_macs_per_token(moe, prompt_len),
            "peak_memory": _peak_memory(device), "repeats": repeats, "compiled": compile,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads()}


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB (CUDA, both models)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB (process peak RSS)"


def _moe_macs_per_token(moe: nn.Module, seq_len: int) -> float:
    """``macs_per_token`` of the nominal routing; for routers with no nominal count (DSMoE's thresholds),
    of the routing measured on one batch of random tokens, as the timed passes ran."""
    try:
        return macs_per_token(moe, seq_len)
    except ValueError:
        ids = torch.randint(0, moe.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), tracking_routing(moe):
            moe(input_ids=ids.to(next(moe.parameters()).device), use_cache=False)
            return macs_per_token(moe, seq_len, measured=True)
