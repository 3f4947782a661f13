"""One decoder layer at a time (after llm-compressor's sequential pipeline).

The model runs once up to the first decoder layer to capture that layer's inputs (hidden states and
the keyword arguments the model passes every layer: position embeddings, masks). Then, layer by
layer: move the layer to the work device, let the caller observe and convert it, run the (possibly
converted) layer on the cached inputs to get the next layer's inputs, move it back. Only one layer's
activations are alive at a time, and later layers are calibrated on the outputs of the converted
earlier ones, so each conversion sees the errors made before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moeify.arch import DecoderAdapter


class _StopForward(Exception):
    """Raised by the capture hook to end the model's forward at the first decoder layer."""


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


@dataclass
class LayerInputs:
    """Cached inputs of one decoder layer, one entry per calibration batch, kept on the offload device."""

    hidden: list[Tensor] = field(default_factory=list)
    kwargs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LayerStep:
    """What the caller gets for layer ``index``: the layer (on the work device) and its inputs."""

    index: int
    layer: nn.Module
    inputs: LayerInputs
    device: torch.device

    def run(self) -> list[Tensor]:
        """Run the layer on every cached batch (observers attach with hooks); outputs on the inputs' device."""
        outputs = []
        with torch.no_grad():
            for hidden, kwargs in zip(self.inputs.hidden, self.inputs.kwargs):
                out = self.layer(hidden.to(self.device), **_move(kwargs, self.device))
                out = out[0] if isinstance(out, tuple) else out
                outputs.append(out.to(hidden.device))
        return outputs


def capture_first_layer_inputs(model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor,
                               batch_size: int) -> LayerInputs:
    """Run the model on ``batches`` (n, seq) and keep what reaches decoder layer 0."""
    cache = LayerInputs()

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        cache.hidden.append(hidden.detach())
        cache.kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _StopForward

    device = next(model.parameters()).device
    handle = adapter.layer(0).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for chunk in batches.split(batch_size):
                try:
                    model(input_ids=chunk.to(device), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
    return cache


def stream_layers(model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor, *,
                  device: torch.device | str, batch_size: int = 1) -> Iterator[LayerStep]:
    """Yield a ``LayerStep`` per decoder layer; after the caller is done with it, its outputs become
    the next layer's inputs."""
    device = torch.device(device)
    inputs = capture_first_layer_inputs(model, adapter, batches, batch_size)
    for index in range(adapter.num_layers):
        home = next(adapter.layer(index).parameters()).device
        step = LayerStep(index, adapter.layer(index).to(device), inputs, device)
        yield step
        step.layer = adapter.layer(index).to(device)  # the caller may have replaced its MLP
        inputs = LayerInputs(step.run(), inputs.kwargs)
        adapter.layer(index).to(home)
