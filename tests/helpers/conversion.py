"""Copying a model before converting it, and the CPU conversion context the unit tests use."""

from __future__ import annotations

import copy

import torch

from moeify.calibration.data import TextSource
from moeify.methods import ConversionContext


def clone(model):
    """A deep copy of ``model`` in eval mode (the original stays the dense reference)."""
    return copy.deepcopy(model).eval()


def assert_cached_generation_equals_uncached(model, prompt: torch.Tensor, new_tokens: int) -> None:
    """Greedy generation with a KV cache gives the tokens of generation without one (the cache slots, the
    layer indices and any per-token state of a converted model are right)."""
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        uncached = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=False,
                                  pad_token_id=0)
    assert torch.equal(cached, uncached)


def conversion_context(model, tokenizer, calib: TextSource, seed: int = 0) -> ConversionContext:
    """A method's context on ``model`` itself (converted in place): CPU, no progress bars."""
    return ConversionContext(model, tokenizer, calib, seed, torch.device("cpu"), progress=False)


# Small options per method, so that each conversion stays well under 2 s; a method not listed runs with its
# defaults (change an entry, and the golden values of test_golden.py must be rewritten).
FAST: dict[str, dict[str, object]] = {
    "cmoe": {"calib_samples": 4, "seq_len": 64},
    "random_split": {"calib_samples": 4, "seq_len": 64},
    "more": {"calib_samples": 8, "seq_len": 64},
    "tomoe": {"steps": 3, "batch_size": 2, "seq_len": 32, "calib_samples": 2, "checkpoint_every": 0},
    "dsmoe": {"steps": 3, "batch_size": 2, "seq_len": 32, "checkpoint_every": 0, "analyses": False},
    "dense2moe": {"calib_samples": 4, "seq_len": 64, "steps": 3, "warmup": 1, "checkpoint_every": 0, "delta": 2.0},
    "static_prune": {"calib_samples": 4, "seq_len": 64},
}
