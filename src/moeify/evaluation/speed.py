"""Forward throughput (tokens/s), warm-up then the median of repeats, on random token ids."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

SPEED_SHAPE = (8, 256)  # batch, sequence of the speed measurement that convert and recover record


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timer must wait for them
        torch.cuda.synchronize(device)


def _timed(run: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run`` after ``warmup`` untimed ones (which also compile a
    compiled model and record its CUDA graphs)."""
    times = []
    for i in range(warmup + repeats):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _spread(times: list[float]) -> float:
    """(slowest - fastest) / median: how much a noisy machine disturbed the timed passes."""
    return (max(times) - min(times)) / statistics.median(times)


def _random_ids(model: nn.Module, batch_size: int, seq_len: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=generator)
    return ids.to(next(model.parameters()).device)


@torch.no_grad()
def forward_tokens_per_s(model: nn.Module, batch_size: int, seq_len: int, *, repeats: int = 5, warmup: int = 2,
                         seed: int = 0) -> float:
    """Median tokens/s of a full forward pass (prefill) over a (batch_size, seq_len) batch."""
    return forward_speed(model, batch_size, seq_len, repeats=repeats, warmup=warmup, seed=seed)[0]


@torch.no_grad()
def forward_speed(model: nn.Module, batch_size: int, seq_len: int, *, repeats: int = 5, warmup: int = 2,
                  seed: int = 0, runner: Callable[..., object] | None = None) -> tuple[float, float]:
    """(median tokens/s, spread) of ``repeats`` timed forward passes after ``warmup`` untimed ones, so a
    noisy machine shows in the record. ``runner``: what runs the forward (a compiled ``model``)."""
    ids = _random_ids(model, batch_size, seq_len, seed)
    run = model if runner is None else runner
    times = _timed(lambda: run(input_ids=ids, use_cache=False), ids.device, repeats, warmup)
    return batch_size * seq_len / statistics.median(times), _spread(times)


def speed_record(dense: tuple[float, float], moe: tuple[float, float], batch_size: int, seq_len: int, *,
                 repeats: int = 5, warmup: int = 2) -> dict[str, Any]:
    """A record's ``speed`` block from two ``forward_speed`` results of one process."""
    return {"batch_size": batch_size, "seq_len": seq_len, "dense_tokens_per_s": dense[0], "tokens_per_s": moe[0],
            "speedup": moe[0] / dense[0], "spread": {"dense": dense[1], "moe": moe[1]}, "repeats": repeats,
            "warmup": warmup}


class _StepClock:
    """A ``generate`` streamer that notes when each step's tokens reach the host: first the prompt (before the
    prefill), then every new token (each after its step's kernels: generate reads the tokens back)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def put(self, _tokens: Tensor) -> None:
        _synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.no_grad()
def decode_speed(model: nn.Module, batch_size: int, prompt_len: int, new_tokens: int, *, repeats: int = 3,
                 warmup: int = 1, seed: int = 0, compiled: dict[str, Any] | None = None) -> tuple[float, float]:
    """(median tokens/s, spread) of greedy decoding with the KV cache, one token per sequence and step: the
    time from the first new token (the end of the prompt's prefill) to the last, over ``new_tokens - 1``
    steps, read off ``generate``'s own steps (``_StepClock``). ``compiled``: the ``generate`` arguments of a
    compiled decode step (``bench.compiled_generation``)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 (the first token comes from the prefill)")
    ids = _random_ids(model, batch_size, prompt_len, seed)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=model.config.eos_token_id or 0, attention_mask=torch.ones_like(ids), **(compiled or {}))
    times = []
    for i in range(warmup + repeats):
        clock = _StepClock(ids.device)
        model.generate(ids, streamer=clock, **kwargs)
        if i >= warmup:
            times.append(clock.times[-1] - clock.times[1])  # times[0]: the prompt, times[1]: the first new token
    return batch_size * (new_tokens - 1) / statistics.median(times), _spread(times)


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
