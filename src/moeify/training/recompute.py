"""Activation checkpointing of the decoder layers: inside ``recomputed_layers(model)`` every decoder
layer run with gradients on keeps only its inputs, and its activations are recomputed in the backward
pass (torch's non-reentrant checkpoint, which also replays the RNG, so random masks are drawn alike).
Training memory then holds one layer's activations instead of all of them, for about a third more
compute. Without gradients (a teacher pass, evaluation) layers run as usual."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moeify.arch import DecoderAdapter


@contextmanager
def recomputed_layers(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Checkpoint every decoder layer of ``model`` (a transformers causal LM) inside the block."""
    layers = list(DecoderAdapter(model).layers) if enabled else []
    own = [layer.__dict__.get("forward") for layer in layers]  # a wrapper's (e.g. accelerate's hooks), if any
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run
