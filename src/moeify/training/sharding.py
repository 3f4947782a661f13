"""Fully sharded data-parallel training (FSDP2, ``torch.distributed.fsdp.fully_shard``), for models whose
weights, gradients and optimizer state do not fit one device once per process.

Inside ``sharded(network, optimizer, device)`` every decoder layer is a ``fully_shard`` unit: each process
keeps 1/N of each of its parameters, of their gradients and of the optimizer's state for them (AdamW's two
moments, the float32 masters of ``precision.py``), and a layer's weights are gathered only while it
computes (its forward, and the backward's recomputation). The full tensors the process held before are
freed. The decoder (the base model) is the root unit. What stays replicated, as in data-parallel
training: the decoder's own parameters (embeddings, final norm) and the output head, which the losses
run a chunk at a time outside the decoder's forward (``losses.py``) where no FSDP hook would gather them
(at 7B-70B the embeddings are 2-13 % of the weights); parameters outside ``network``; and those the
caller names, which a loss also runs outside the layers (ToMoE's hypernetwork and mask projections;
ToMoE's frozen MLP weights are held by its masked MLPs as plain tensors, outside the module tree, so only
its attention is sharded). The training loop's arithmetic is unchanged: each process weights its windows'
losses by their share of the global batch, and the gradients are summed, not averaged, over the processes
(a gradient divide factor of 1; the loop sums the replicated parameters' gradients itself), so a sharded
run takes the steps the replicated one takes, up to float summation order.

A checkpoint reads the sharded model and optimizer as they are, gathering one tensor at a time to the CPU
(``checkpoint.py``; only the process that writes keeps them), and a resume copies each process's slice of
each saved tensor into its shards, one tensor at a time, so no device ever holds the whole training state.
Leaving ``sharded`` turns the model back into the plain one (the same ``Parameter`` objects, holding the
full trained tensors; the modules' own classes), which the rest of the conversion reads; the optimizer's
state, no longer needed, is dropped rather than gathered.
Undoing ``fully_shard`` has no public API (FSDP2 is meant to stay for a module's life): ``_detach`` removes
what ``fully_shard`` attaches in torch 2.13 (its hooks, its class in the MRO, its state records) and is
pinned by a test that trains sharded and compares the gathered model with unsharded training.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from moeify.arch import DecoderAdapter
from moeify.arch.head import causal_lm
from moeify.offload.allocator import release_freed_memory
from moeify.training.distributed import world_size
from moeify.training.precision import to_float32_

_MANAGED_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


@dataclass
class Shards:
    """The sharding of one training run: its units and the plain parameters they stand for."""

    optimizer: torch.optim.Optimizer
    mesh: DeviceMesh
    layers: list[nn.Module]
    root: nn.Module  # the decoder (the base model): what runs the layers
    replicated: set[nn.Parameter]  # parameters of the layers a loss also uses outside their forward passes
    # (module, attribute, the plain Parameter the module held before sharding), tied ones once per module
    owners: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)

    @property
    def units(self) -> list[nn.Module]:
        return [*self.layers, self.root]

    def shard(self) -> None:
        """Make every unit a ``fully_shard`` unit; the optimizer follows its parameters to their shards. What
        the optimizer trains becomes float32 (its masters, ``precision.py``) a layer at a time, just before
        the layer is sharded, so no process ever holds the whole model in float32."""
        self.owners = [(module, name, param) for layer in self.layers for module in layer.modules()
                       for name, param in module._parameters.items()
                       if param is not None and param not in self.replicated]
        in_layers = {plain for _, _, plain in self.owners}
        outside = {p for p in self.root.parameters() if p not in in_layers}  # the root's own: replicated
        trained = {p for group in self.optimizer.param_groups for p in group["params"]}
        to_float32_(trained.intersection(outside))
        for layer in self.layers:
            plain = [p for p in layer.parameters() if p not in self.replicated]
            to_float32_(trained.intersection(plain))
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=True,
                        ignored_params={p for p in layer.parameters() if p in self.replicated})
            for param in plain:  # the layer's shards hold its values now
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        fully_shard(self.root, mesh=self.mesh, reshard_after_forward=True, ignored_params=outside)
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)  # a sum: the losses already carry each process's share
            unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
        _point_optimizer_(self.optimizer, {id(plain): module._parameters[name] for module, name, plain in self.owners})
        release_freed_memory()  # the full tensors freed above, on the CPU

    def gather(self) -> None:
        """Undo ``shard`` once training is over: the full tensors back in the plain parameters, on the units'
        own classes. The optimizer's state and the gradients, no longer needed, are dropped first, so a
        process holds the full model beside the model's shards only."""
        self.optimizer.state.clear()
        full: dict[int, Tensor] = {}
        plain_of: dict[int, nn.Parameter] = {}
        for module, name, _ in self.owners:
            module._parameters[name].grad = None
        for module, name, plain in self.owners:
            param = module._parameters[name]
            if id(plain) not in full:  # collective: every process gathers the same tensors in the same order
                full[id(plain)] = _whole(param.full_tensor().detach())
                plain_of[id(param)] = plain
            plain.data = full[id(plain)]
            plain.grad = None
            module._parameters[name] = plain
        for group in self.optimizer.param_groups:
            group["params"] = [plain_of.get(id(p), p) for p in group["params"]]
        for unit in reversed(self.units):
            _detach(unit)
        for module in self.root.modules():
            for flag in _MANAGED_FLAGS:
                module.__dict__.pop(flag, None)


def _point_optimizer_(optimizer: torch.optim.Optimizer, sharded: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer`` at ``sharded[id(param)]`` for each of its parameters that has one. It has taken no
    step yet, so it holds no state to move; a checkpoint's state is restored into the shards afterwards."""
    for group in optimizer.param_groups:
        group["params"] = [sharded.get(id(p), p) for p in group["params"]]


def _whole(tensor: Tensor) -> Tensor:
    """``tensor`` in a storage of its own: a gathered tensor can be a view into a padded buffer, which
    safetensors refuses to save (and which would keep the padding alive)."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def _detach(unit: nn.Module) -> None:
    """Remove what ``fully_shard`` attached to ``unit`` (torch 2.13): forward hooks, the FSDP class in
    its MRO, the composable-API state records."""
    state = unit._get_fsdp_state()
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    unit.__class__ = next(cls for cls in type(unit).__mro__ if not issubclass(cls, FSDPModule))
    unit.__dict__.pop(STATE_KEY, None)
    unit.__dict__.pop(REGISTRY_KEY, None)
    _module_state_mapping.pop(unit, None)


@contextmanager
def sharded(network: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
            replicated: Iterable[nn.Parameter] = (), enabled: bool = True) -> Iterator[Shards | None]:
    """``network`` (a transformers causal LM) sharded over the processes inside the block, one unit per
    decoder layer plus the root; None when not ``enabled``. ``replicated``: parameters inside the layers
    that stay whole (a loss uses them outside the layers' forward passes). Call it before the optimizer's
    first step, and restore a checkpoint inside the block (``checkpoint.py`` cuts it like the shards)."""
    if not enabled:
        yield None
        return
    shards = Shards(optimizer, init_device_mesh(device.type, (world_size(),)), list(DecoderAdapter(network).layers),
                    causal_lm(network).base_model, set(replicated))
    shards.shard()
    yield shards
    shards.gather()  # not after an error: the other processes may wait elsewhere, and the run is lost anyway
