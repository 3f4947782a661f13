"""Dense vs MoE speed in one process (what ``moeify bench`` prints)."""

from __future__ import annotations

import resource
from typing import Any

import torch
from torch import nn

from moeify.evaluation.speed import decode_tokens_per_s, forward_tokens_per_s, macs_per_token
from moeify.moe.accounting import tracking_routing


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB (CUDA, both models)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB (process peak RSS)"


def benchmark_pair(dense: nn.Module, moe: nn.Module, batch_sizes: list[int], seq_len: int, new_tokens: int,
                   repeats: int) -> dict[str, Any]:
    """Prefill tokens/s per batch size, decode tokens/s at the largest batch, ideal speed-up, peak memory."""
    device = next(moe.parameters()).device
    prefill = []
    for batch in batch_sizes:
        d = forward_tokens_per_s(dense, batch, seq_len, repeats=repeats)
        m = forward_tokens_per_s(moe, batch, seq_len, repeats=repeats)
        prefill.append({"batch_size": batch, "seq_len": seq_len, "dense": d, "moe": m, "speedup": m / d})
    batch = max(batch_sizes)
    d = decode_tokens_per_s(dense, batch, seq_len, new_tokens, repeats=max(1, repeats // 2))
    m = decode_tokens_per_s(moe, batch, seq_len, new_tokens, repeats=max(1, repeats // 2))
    return {"prefill": prefill,
            "decode": {"batch_size": batch, "prompt_len": seq_len, "new_tokens": new_tokens, "dense": d, "moe": m,
                       "speedup": m / d},
            "ideal_speedup": macs_per_token(dense, seq_len) / _moe_macs_per_token(moe, seq_len),
            "peak_memory": _peak_memory(device), "repeats": repeats}


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
