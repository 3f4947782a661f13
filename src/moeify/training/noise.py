"""Random numbers drawn inside a training step that do not depend on how the step's batch is split.

A loss that draws noise (ToMoE's Gumbel samples) asks ``uniform(like, key)`` for it, ``key`` naming what
the draw is for (e.g. ``("router", layer)``). The training loop opens ``step_noise(seed, step, windows)``
around each micro-batch, ``windows`` being the micro-batch's rows in the step's whole batch; inside it a
per-window draw gives row b of ``like`` numbers from a generator seeded by (seed, step, key, window b),
and a per-step draw (``per_window=False``) numbers seeded by (seed, step, key). Hence one process with the
whole batch, several processes with a share each, any number of micro-batches, the forward recomputed in
the backward pass (activation checkpointing) and a run resumed from a checkpoint all draw the same
numbers for the same window. Outside such a block (inference, unit tests) draws come from torch's global
generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _StepNoise:
    seed: int
    step: int
    windows: tuple[int, ...]


_current: ContextVar[_StepNoise | None] = ContextVar("moeify_step_noise", default=None)


@contextmanager
def step_noise(seed: int, step: int, windows: Sequence[int]) -> Iterator[None]:
    """Inside the block, ``uniform`` draws the noise of optimizer step ``step`` for these rows of its batch."""
    token = _current.set(_StepNoise(seed, step, tuple(int(w) for w in windows)))
    try:
        yield
    finally:
        _current.reset(token)


def _seed(*parts: Hashable) -> int:
    """A 63-bit generator seed from ``parts`` (stable across processes and runs, unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _draw(shape: Sequence[int], like: Tensor, seed: int) -> Tensor:
    generator = torch.Generator(device=like.device).manual_seed(seed)
    return torch.rand(tuple(shape), generator=generator, dtype=like.dtype, device=like.device)


def uniform(like: Tensor, key: Hashable, per_window: bool = True) -> Tensor:
    """U(0, 1) samples shaped like ``like``; ``per_window``: ``like``'s first dimension runs over the
    micro-batch's windows (see the module docstring)."""
    noise = _current.get()
    if noise is None:
        return torch.rand(like.shape, dtype=like.dtype, device=like.device)
    if not per_window:
        return _draw(like.shape, like, _seed(noise.seed, noise.step, key))
    if like.shape[0] != len(noise.windows):
        raise ValueError(f"a per-window draw of shape {tuple(like.shape)} for a micro-batch of "
                         f"{len(noise.windows)} windows")
    return torch.stack([_draw(like.shape[1:], like, _seed(noise.seed, noise.step, key, window))
                        for window in noise.windows])
