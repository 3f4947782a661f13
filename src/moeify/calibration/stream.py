"""One decoder layer at a time (after llm-compressor's sequential pipeline).

The model runs once with every decoder layer standing aside (each records the keyword arguments the
model passes it and returns its input unchanged) to capture layer 0's hidden states and every layer's
own arguments: models whose layers differ (sliding and full attention alternating, a rotary base per
layer type, as Gemma-2/3 and Qwen2 with ``layer_types`` do) give each layer its own mask and position
embeddings, and a layer must be replayed with its own. Arguments shared by all layers are one object,
stored once. Then, layer by layer: move the layer to the work device, let the caller observe and
convert it, run the (possibly converted) layer on the cached inputs to get the next layer's inputs,
move it back. Only one layer's activations are alive at a time, and later layers are calibrated on the
outputs of the converted earlier ones, so each conversion sees the errors made before it.
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


def capture_layer_inputs(model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor,
                         batch_size: int) -> tuple[list[Tensor], list[list[dict[str, Any]]]]:
    """Run the model on ``batches`` (n, seq) with its decoder layers standing aside.

    Returns layer 0's hidden states (one tensor per batch) and, per layer, the keyword arguments the
    model passed it (one dict per batch). No layer computes anything; the forward stops after the last.
    """
    hidden: list[Tensor] = []
    kwargs: list[list[dict[str, Any]]] = [[] for _ in range(adapter.num_layers)]

    def stand_in(index: int):
        def forward(hidden_states: Tensor, *args: Any, **layer_kwargs: Any) -> Tensor:
            if args:
                raise TypeError(f"decoder layer {index} got positional arguments beyond the hidden states")
            if index == 0:
                hidden.append(hidden_states.detach())
            kwargs[index].append(layer_kwargs)
            if index == adapter.num_layers - 1:
                raise _StopForward
            return hidden_states
        return forward

    device = next(model.parameters()).device
    layers = [adapter.layer(i) for i in range(adapter.num_layers)]
    for index, layer in enumerate(layers):
        layer.forward = stand_in(index)  # an instance attribute shadows the class's forward
    try:
        with torch.no_grad():
            for chunk in batches.split(batch_size):
                try:
                    model(input_ids=chunk.to(device), use_cache=False)
                except _StopForward:
                    pass
    finally:
        for layer in layers:
            del layer.forward
    return hidden, kwargs


def stream_layers(model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor, *,
                  device: torch.device | str, batch_size: int = 1) -> Iterator[LayerStep]:
    """Yield a ``LayerStep`` per decoder layer; after the caller is done with it, its outputs become
    the next layer's inputs."""
    device = torch.device(device)
    hidden, kwargs = capture_layer_inputs(model, adapter, batches, batch_size)
    for index in range(adapter.num_layers):
        home = next(adapter.layer(index).parameters()).device
        step = LayerStep(index, adapter.layer(index).to(device), LayerInputs(hidden, kwargs[index]), device)
        yield step
        step.layer = adapter.layer(index).to(device)  # the caller may have replaced its MLP
        hidden = step.run()
        adapter.layer(index).to(home)
