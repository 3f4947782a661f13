"""Forward throughput (tokens/s), warm-up then the median of repeats, on random token ids."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


@torch.no_grad()
def forward_tokens_per_s(model: nn.Module, batch_size: int, seq_len: int, *, repeats: int = 5, warmup: int = 2,
                         seed: int = 0) -> float:
    """Median tokens/s of a full forward pass (prefill) over a (batch_size, seq_len) batch."""
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
    return batch_size * seq_len / statistics.median(times)
