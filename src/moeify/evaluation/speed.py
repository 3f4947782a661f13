"""Forward throughput (tokens/s), warm-up then the median of repeats, on random token ids."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

SPEED_SHAPE = (8, 256)  # batch, sequence of the speed measurement that convert and recover record


@torch.no_grad()
def forward_tokens_per_s(model: nn.Module, batch_size: int, seq_len: int, *, repeats: int = 5, warmup: int = 2,
                         seed: int = 0) -> float:
    """Median tokens/s of a full forward pass (prefill) over a (batch_size, seq_len) batch."""
    return forward_speed(model, batch_size, seq_len, repeats=repeats, warmup=warmup, seed=seed)[0]


def forward_speed(model: nn.Module, batch_size: int, seq_len: int, *, repeats: int = 5, warmup: int = 2,
                  seed: int = 0) -> tuple[float, float]:
    """(median tokens/s, spread) of ``repeats`` timed forward passes after ``warmup`` untimed ones; the
    spread is (slowest - fastest) / median time, so a noisy machine shows in the record."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return batch_size * seq_len / median, (max(times) - min(times)) / median


def speed_record(dense: tuple[float, float], moe: tuple[float, float], batch_size: int, seq_len: int, *,
                 repeats: int = 5, warmup: int = 2) -> dict[str, Any]:
    """A record's ``speed`` block from two ``forward_speed`` results of one process."""
    return {"batch_size": batch_size, "seq_len": seq_len, "dense_tokens_per_s": dense[0], "tokens_per_s": moe[0],
            "speedup": moe[0] / dense[0], "spread": {"dense": dense[1], "moe": moe[1]}, "repeats": repeats,
            "warmup": warmup}


@torch.no_grad()
def decode_tokens_per_s(model: nn.Module, batch_size: int, prompt_len: int, new_tokens: int, *, repeats: int = 3,
                        seed: int = 0) -> float:
    """Median tokens/s of greedy generation with the KV cache (``new_tokens`` per sequence)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), generator=generator).to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=model.config.eos_token_id or 0, attention_mask=torch.ones_like(ids))
    model.generate(ids, **kwargs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        times.append(time.perf_counter() - start)
    return batch_size * new_tokens / statistics.median(times)


def macs_per_token(model: nn.Module, seq_len: int, measured: bool = False) -> float:
    """Multiply-accumulates per token: the activated projections (attention + MLP, as in the activated-
    parameter accounting), the attention scores (QK^T and AV over seq_len/2 keys on average, causal) and
    the LM head. Routers and norms are ignored (small)."""
    from moeify.arch.standard_moe import decoder_layers
    from moeify.moe.accounting import activated_parameters

    active = activated_parameters(model, measured=measured).active_params
    head = model.get_output_embeddings().weight.numel()
    scores = len(decoder_layers(model)) * seq_len * model.config.hidden_size
    return active + scores + head
