"""A model larger than memory, held one decoder layer at a time.

The model is built with its parameters on the meta device (shapes, no storage; buffers as usual, so
rotary frequencies are computed from the config as transformers computes them), then everything outside
the decoder layers (embeddings, final norm, output head: what every forward needs) is read from the
checkpoint. A decoder layer is read when a layer-at-a-time pass (``calibration.stream``) reaches it and
returned to the meta device when the pass is done with it; inside ``writing(folder)`` (a conversion), the
layer as the method left it is first cast to the working dtype and written to its own safetensors file,
and those files become the layers' source afterwards: the converted model is evaluated and saved from
them. Peak memory: the non-layer weights, one layer (dense and converted), the pass's activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from weakref import WeakKeyDictionary

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from moeify.arch import DecoderAdapter
from moeify.arch.head import causal_lm
from moeify.offload.allocator import LAYER_PASS_MMAP_THRESHOLD, fix_mmap_threshold
from moeify.offload.checkpoint import TensorFiles, tensor_bytes, write_index, write_tensors
from moeify.runtime.moe import drop_inference_copies

_LAYERED: WeakKeyDictionary[nn.Module, LayeredModel] = WeakKeyDictionary()
BASE_FILE = "model-base.safetensors"  # everything outside the decoder layers, in a saved folder


def layered_of(model: nn.Module) -> LayeredModel | None:
    """The layer store of a model loaded layer by layer, or None for a model held whole."""
    return _LAYERED.get(causal_lm(model))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (their buffers stay real)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def cast_new_state(module: nn.Module, dtype: torch.dtype, kept_buffers: set[str]) -> None:
    """Every floating parameter of ``module``, and every floating buffer not in ``kept_buffers`` (names
    relative to ``module``) nor in its module's ``float32_buffers`` (e.g. TEAL's thresholds), to ``dtype``:
    what a conversion built in float32 joins the working dtype."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for module_name, sub in module.named_modules():
            for attr, buffer in sub._buffers.items():  # in place: persistence and hooks stay as they are
                name = f"{module_name}.{attr}" if module_name else attr
                if buffer is not None and buffer.is_floating_point() and name not in kept_buffers \
                        and attr not in getattr(sub, "float32_buffers", ()):
                    sub._buffers[attr] = buffer.to(dtype)


class LayeredModel:
    """The decoder layers of ``model``, read from ``source`` one at a time (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, source: TensorFiles, dtype: torch.dtype) -> None:
        self.model, self.source, self.dtype = model, source, dtype
        self.adapter = DecoderAdapter(model)
        names = {id(module): name for name, module in model.named_modules()}
        self.prefixes = [names[id(self.adapter.layer(i))] + "." for i in range(self.adapter.num_layers)]
        self._sink: Path | None = None
        self._written: dict[int, Path] = {}

    def layer_names(self, index: int) -> list[str]:
        """The checkpoint names of layer ``index``'s tensors."""
        return [self.prefixes[index] + name for name in self.adapter.layer(index).state_dict()]

    def materialise(self, index: int, device: torch.device) -> nn.Module:
        """Layer ``index`` read from the source onto ``device``, its parameters in the working dtype."""
        layer = self.adapter.layer(index)
        params = {name for name, _ in layer.named_parameters()}
        prefix = self.prefixes[index]
        tensors = self.source.read(self.layer_names(index))
        state = {name[len(prefix):]: t for name, t in tensors.items()}
        state = {name: (t.to(self.dtype) if name in params and t.is_floating_point() else t).to(device)
                 for name, t in state.items()}
        layer.load_state_dict(state, assign=True)
        return layer.to(device)

    def release(self, index: int) -> None:
        """Layer ``index`` back on the meta device: its weights (and any packed copy of its experts) freed."""
        layer = self.adapter.layer(index)
        drop_inference_copies(layer)
        layer.load_state_dict({name: torch.empty(t.shape, dtype=t.dtype, device="meta")
                               for name, t in layer.state_dict().items()}, assign=True)

    def finish(self, index: int) -> None:
        """The pass is done with layer ``index``: written first (inside ``writing``; the pass has cast it back
        to the working dtype), then released."""
        if self._sink is not None:
            layer = self.adapter.layer(index)
            path = self._sink / f"layer-{index:05d}.safetensors"
            write_tensors({self.prefixes[index] + name: t for name, t in layer.state_dict().items()}, path)
            self._written[index] = path
        self.release(index)

    @contextmanager
    def writing(self, folder: Path) -> Iterator[None]:
        """Inside: every layer a pass finishes is written into ``folder``; after: those files are the
        layers' source (a pass must have finished every layer)."""
        folder.mkdir(parents=True, exist_ok=True)
        self._sink, self._written = folder, {}
        try:
            yield
        finally:
            self._sink = None
        missing = sorted(set(range(self.adapter.num_layers)) - set(self._written))
        if missing:
            raise RuntimeError(f"the layer-by-layer conversion did not finish decoder layers {missing}")
        self.source = TensorFiles.of_files({name: self._written[index] for index in range(self.adapter.num_layers)
                                            for name in self.layer_names(index)})

    def save_weights(self, folder: Path) -> None:
        """The whole model's weights into ``folder``: the non-layer tensors in one file, each layer in its
        own (as read from the source), and the index naming them."""
        layers_prefix = self.adapter.layers_path + "."
        base, seen = {}, set()
        for name, t in self.model.state_dict().items():
            if not name.startswith(layers_prefix) and t.data_ptr() not in seen:  # tied weights once
                seen.add(t.data_ptr())
                base[name] = t
        write_tensors(base, folder / BASE_FILE)
        weight_map, total = dict.fromkeys(base, BASE_FILE), tensor_bytes(base.values())
        for index in range(self.adapter.num_layers):
            tensors = self.source.read(self.layer_names(index))
            file = f"model-layer-{index:05d}.safetensors"
            write_tensors(tensors, folder / file)
            weight_map.update(dict.fromkeys(tensors, file))
            total += tensor_bytes(tensors.values())
        write_index(weight_map, total, folder)


def _stored_name_to_model_name(model: PreTrainedModel) -> Callable[[str], str]:
    """The renaming transformers applies to ``model``'s checkpoint names as it loads them (e.g. GPT-NeoX's
    ``embed_out`` is ``lm_head`` in memory); checkpoints that need tensors merged or split are refused."""
    transforms = get_model_conversion_mapping(model)
    merging = [t for t in transforms if not isinstance(t, WeightRenaming)]
    if merging:
        raise ValueError(f"{type(model).__name__} checkpoints need tensors merged or split as they load "
                         f"({type(merging[0]).__name__}); layer-by-layer loading only reads them as stored")

    def rename(name: str) -> str:
        for transform in transforms:
            name = transform.rename_source_key(name)[0]
        return name

    return rename


def layered_model(folder: Path, build: Callable[[], PreTrainedModel], dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> PreTrainedModel:
    """The model ``build`` makes (parameters on the meta device), with the non-layer weights of the
    checkpoint in ``folder`` on ``device`` in ``dtype``; its decoder layers are read when a pass needs them."""
    fix_mmap_threshold(LAYER_PASS_MMAP_THRESHOLD)  # each layer's freed weights go back to the system
    with parameters_on_meta():
        model = build()
    source = TensorFiles.of_folder(folder, _stored_name_to_model_name(model))
    layered = LayeredModel(model, source, dtype)
    layers = {name for i in range(layered.adapter.num_layers) for name in layered.layer_names(i)}
    own = model.state_dict()
    present = sorted(name for name in own if name not in layers and name in source.names())
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state = {name: (t.to(dtype) if name in params and t.is_floating_point() else t).to(device)
             for name, t in source.read(present).items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # an output head tied to the embeddings is not in the checkpoint
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta" and name not in layers]
    if missing:
        raise ValueError(f"{folder}: tensor {missing[0]!r} is not in the checkpoint; layer-by-layer loading needs "
                         "a checkpoint whose tensor names are the model's own (as save_pretrained writes them)")
    for module in model.modules():  # buffers (rotary frequencies) join the weights' device
        for attr, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[attr] = buffer.to(device)
    _LAYERED[model] = layered
    return model.eval()

