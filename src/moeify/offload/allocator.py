"""Keep glibc from holding freed memory (training steps, layer-at-a-time passes over models larger than memory).

glibc serves an allocation from its heap unless it is larger than the mmap threshold, and it raises that
threshold (from 128 KiB up to 32 MiB) each time a large mmap-ed block is freed. A training step then puts
its layer activations (a few MiB each) on the heap, frees them and allocates others of other sizes, and
the heap fragments: the process keeps gigabytes of freed memory. Measured on SmolLM2-135M, CMoE's
fine-tune at 4 x 512 tokens (benchmarks/bench_train_memory.py): a fixed 4 MiB threshold nearly halves the
peak RSS of glibc's dynamic one, at about a fifth more time per step (the page faults of mapping fresh
memory); 1 MiB saves a little more memory for more time still. A layer-at-a-time pass frees a layer's
weights (tens of MiB) per layer: with the dynamic threshold a 1.1B-parameter model held a layer at a
time grew by about a layer per layer, to about twice the peak it keeps with a fixed 1 MiB one.
A fixed threshold is set for the rest of the process, unless the user chose one (``MALLOC_MMAP_THRESHOLD_``)
or the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
TRAINING_MMAP_THRESHOLD = 4 * 2 ** 20
LAYER_PASS_MMAP_THRESHOLD = 2 ** 20


def fix_mmap_threshold(threshold: int = TRAINING_MMAP_THRESHOLD) -> bool:
    """Give glibc a fixed mmap threshold; True when it took effect."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold))


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``): memory freed inside the heap
    (e.g. weights loaded before the threshold was fixed) otherwise stays in the process, since later large
    tensors are mapped afresh. True when it released anything."""
    trim = _glibc("malloc_trim")
    return trim is not None and bool(trim(0))


def _glibc(name: str) -> Callable[..., int] | None:
    """glibc's function ``name``, or None where the C library is another (musl, macOS, Windows): nothing
    to tune there."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
