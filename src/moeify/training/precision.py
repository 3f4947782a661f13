"""Mixed-precision training: a model held in bfloat16 or float16 trains with float32 master weights.

An AdamW update moves a weight by about lr times its own scale; at lr 1e-4 that is far below bfloat16's
resolution (2^-8, 0.4 % relative), so applied to bfloat16 weights most updates round away and a bfloat16
run drifts from its float32 twin. So, as torch's automatic mixed precision does:

- the parameters the optimizer updates are held in float32 while training (frozen ones stay in the
  working dtype) and cast back when training ends, so a bfloat16 conversion still saves bfloat16;
- when weights stay frozen in the working dtype (a LoRA fine-tune's base), the forward
  passes run under ``torch.autocast`` in it: matrix products in it on the rounded float32 weights,
  reductions and the losses in float32 (the backward follows the forward's dtypes);
- when every parameter is trained (DSMoE, Dense2MoE), the masters make the whole model float32 already,
  and it computes in float32: autocast would save activation memory and GPU time but its rounded
  gradients move the result (Dense2MoE on SmolLM2, 10 steps: a few percent in perplexity from the float32
  run under bfloat16 autocast, well under a tenth of a percent in float32 arithmetic:
  ``benchmarks/bench_bf16.py``);
- or a method holds its frozen low-precision weights in float32 while it trains (``held_in_float32``):
  the run then computes exactly what the float32 conversion of the same weights computes (a bfloat16
  number is a float32 one), at the cost of float32 weights in memory. Where a run's hard decisions make
  it land elsewhere under the smallest change of its gradients (ToMoE's masks at a few hundred steps:
  its autocast and float32 runs on SmolLM2 land a few percent apart in perplexity), only this keeps a
  bfloat16 conversion the float32 one's model;
- float16 (smallest normal 6e-5) under autocast: the gradient of a mean over thousands of tokens
  underflows, so the loss is scaled (``torch.amp.GradScaler``: a dynamic scale; a step whose gradients
  hold inf/NaN is skipped and the scale halved). bfloat16 has float32's range and needs no scaling.

A checkpoint written while training holds the float32 master weights (they are the model's parameters
then) and the scaler's state, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


def low_precision_dtype(model: nn.Module, skip: set[int] = frozenset()) -> torch.dtype:
    """The dtype that holds most of ``model``'s parameters below float32 (float32 when none is), leaving out
    those whose id is in ``skip``."""
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32 and id(p) not in skip:
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else torch.float32


@dataclass
class Precision:
    """How a training step computes: the autocast dtype (``float32``: no autocast) and the loss scaler
    (float16 only)."""

    dtype: torch.dtype
    device: torch.device
    scaler: torch.amp.GradScaler | None = None

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def backward(self, loss: Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step on the unscaled gradients (skipped by the scaler when they overflowed)."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def state(self) -> dict[str, Any]:
        """The scaler's state for a checkpoint (JSON: floats and ints); empty without one."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def to_float32_(params: Iterable[Tensor]) -> None:
    """Hold each low-precision parameter (or buffer) in float32, in place (the masters; frozen weights held in
    float32): the same ``Parameter`` objects, so an optimizer's references to them stay valid."""
    for p in params:
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()


@contextmanager
def held_in_float32(module: nn.Module) -> Iterator[None]:
    """``module``'s low-precision parameters and buffers held in float32, in place, inside the block, and
    back in their dtypes on leaving (exactly: they were those dtypes' numbers). What computes with the
    module inside the block computes what the float32 module would; what is built inside it (new layers)
    stays float32 for the caller to cast."""
    tensors = [t for t in (*module.parameters(), *module.buffers())
               if t.is_floating_point() and t.dtype != torch.float32]
    dtypes = [t.dtype for t in tensors]
    to_float32_(tensors)
    try:
        yield
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)


@contextmanager
def mixed_precision(network: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                    upcast: bool = True) -> Iterator[Precision]:
    """Inside the block the optimizer's low-precision parameters are float32 masters and the returned
    ``Precision`` computes in ``network``'s working dtype, or in float32 when no low-precision parameter
    is left; on leaving, the masters return to their dtypes. ``upcast=False``: the caller makes the masters
    float32 itself before training (``sharding.py``: a layer at a time, as it shards them)."""
    masters = [p for group in optimizer.param_groups for p in group["params"]
               if p.is_floating_point() and p.dtype != torch.float32]
    original = [p.dtype for p in masters]
    if upcast:
        to_float32_(masters)
    dtype = low_precision_dtype(network, skip={id(p) for p in masters})  # float32 when every one is a master
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    try:
        yield Precision(dtype, device, scaler)
    finally:
        for p, kind in zip(masters, original):
            p.data = p.data.to(kind)
            p.grad = None
