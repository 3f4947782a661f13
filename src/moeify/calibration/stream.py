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

Calibration computes in float32 whatever the working dtype: a bfloat16 layer is cast up while the pass
holds it (one layer at a time, so the memory is a layer's, not a model's) and cast back, with what the
method built in it, when the pass leaves it. So a bfloat16 conversion takes the decisions (channel
rankings, clusters, thresholds) the float32 one takes on the same weights, instead of ones disturbed by
bfloat16's 8-bit mantissa; the converted model then runs in the working dtype.

A model loaded layer by layer (``moeify.offload``) has its layers read from disk when the pass reaches
them and released (written first, in a conversion) when it leaves them. ``final_states`` computes a
model's output hidden states the same way, for evaluations of models larger than memory (as GPTQ-style
evaluation does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moeify.arch import DecoderAdapter
from moeify.arch.head import causal_lm
from moeify.offload import cast_new_state, layered_of
from moeify.runtime.moe import drop_inference_copies


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


def _chunks(batches: Tensor | list[Tensor], batch_size: int) -> list[Tensor]:
    """``batches`` (n, seq) in chunks of ``batch_size``, or a list of batches as they are."""
    return list(batches) if isinstance(batches, list) else list(batches.split(batch_size))


def capture_layer_inputs(model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor | list[Tensor],
                         batch_size: int, float32: bool = False) -> tuple[list[Tensor], list[list[dict[str, Any]]]]:
    """Run the model on ``batches`` ((n, seq) in chunks of ``batch_size``, or a list of batches) with its
    decoder layers standing aside.

    Returns layer 0's hidden states (one tensor per batch) and, per layer, the keyword arguments the
    model passed it (one dict per batch). No layer computes anything; the forward stops after the last.
    ``float32``: the embeddings' output is cast to float32, so the model derives everything it passes its
    layers (the rotary cos/sin, an additive attention mask) in float32 too, as a float32 model does.
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
    embeddings = model.get_input_embeddings()
    upcast = embeddings.register_forward_hook(lambda module, args, out: out.float()) if float32 else None
    try:
        with _standing_in(adapter, stand_in), torch.no_grad():
            for chunk in _chunks(batches, batch_size):
                try:
                    model(input_ids=chunk.to(device), use_cache=False)
                except _StopForward:
                    pass
    finally:
        if upcast is not None:
            upcast.remove()
    return hidden, kwargs


@contextmanager
def _standing_in(adapter: DecoderAdapter, forward_for: Callable[[int], Callable[..., Tensor]]) -> Iterator[None]:
    """Inside, decoder layer ``i`` runs ``forward_for(i)`` instead of its own forward."""
    layers = [adapter.layer(i) for i in range(adapter.num_layers)]
    for index, layer in enumerate(layers):
        layer.forward = forward_for(index)  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


class LayerStream:
    """The layers of a pass, one ``LayerStep`` at a time (see ``stream_layers``); once iterated,
    ``outputs`` holds the last layer's outputs, one tensor per batch."""

    def __init__(self, model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor | list[Tensor],
                 device: torch.device, batch_size: int, float32: bool) -> None:
        self.model, self.adapter, self.batches = model, adapter, batches
        self.device, self.batch_size, self.float32 = device, batch_size, float32
        self.outputs: list[Tensor] = []

    def __len__(self) -> int:
        return self.adapter.num_layers

    def __iter__(self) -> Iterator[LayerStep]:
        adapter, layered = self.adapter, layered_of(self.model)
        dtype = self.model.get_input_embeddings().weight.dtype  # the working dtype
        upcast = self.float32 and dtype != torch.float32
        hidden, kwargs = capture_layer_inputs(self.model, adapter, self.batches, self.batch_size, float32=upcast)
        for index in range(adapter.num_layers):
            if layered is None:
                home = next(adapter.layer(index).parameters()).device
                layer = adapter.layer(index).to(self.device)
            else:
                layer = layered.materialise(index, self.device)
            kept = {name for name, _ in layer.named_buffers()}
            # a model held whole keeps its weights' storage (on the CPU, often the checkpoint's memory map)
            originals = {param: param.data for param in layer.parameters()} if upcast and layered is None else {}
            if upcast:
                cast_new_state(layer, torch.float32, kept)
            step = LayerStep(index, layer, LayerInputs(hidden, kwargs[index]), self.device)
            yield step
            step.layer = adapter.layer(index).to(self.device)  # the caller may have replaced its MLP
            hidden = step.run()
            if upcast:  # the layer (and what the caller built in it) back in the working dtype
                _restore(step.layer, originals)
                cast_new_state(step.layer, dtype, kept)
                # a float32 packed copy of its experts, built by that run, would stay until the layer's next
                # forward: twice its experts' weights per layer, the whole model's at the evaluation's start
                drop_inference_copies(step.layer)
            if layered is None:
                adapter.layer(index).to(home)
            else:
                layered.finish(index)
        self.outputs = [h.to(dtype) for h in hidden]


def _restore(layer: nn.Module, originals: dict[nn.Parameter, Tensor]) -> None:
    """Each parameter the pass cast up and nobody changed gets its own storage back (a checkpoint's memory
    map, not a copy of it)."""
    for param in layer.parameters():
        original = originals.get(param)
        if original is not None and torch.equal(param.data.to(original.dtype), original):
            param.data = original


def stream_layers(model: PreTrainedModel, adapter: DecoderAdapter, batches: Tensor | list[Tensor], *,
                  device: torch.device | str, batch_size: int = 1) -> LayerStream:
    """A ``LayerStep`` per decoder layer, computing in float32 whatever the working dtype (see the module
    docstring); after the caller is done with it, its outputs become the next layer's inputs."""
    return LayerStream(model, adapter, batches, torch.device(device), batch_size, float32=True)


def final_states(model: PreTrainedModel, batches: list[Tensor], device: torch.device | str,
                 progress: bool = False) -> list[Tensor]:
    """The decoder's output after its final norm for each of ``batches``, computed a layer at a time: the
    layers run over every batch, then the model's forward runs once more with the last layer handing it
    the cached outputs (the other layers standing aside), so the model applies its own final norm."""
    from tqdm.auto import tqdm

    adapter = DecoderAdapter(model)
    stream = LayerStream(model, adapter, batches, torch.device(device), batch_size=1, float32=False)
    for _ in tqdm(stream, desc="layer by layer", disable=not progress):
        pass
    outputs = iter(stream.outputs)
    last = adapter.num_layers - 1

    def stand_in(index: int):
        def forward(hidden_states: Tensor, *args: Any, **layer_kwargs: Any) -> Tensor:
            return next(outputs).to(hidden_states.device) if index == last else hidden_states
        return forward

    with _standing_in(adapter, stand_in), torch.no_grad():
        return [causal_lm(model).base_model(input_ids=batch.to(device), use_cache=False).last_hidden_state
                for batch in batches]
