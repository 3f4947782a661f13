"""Data-parallel training across processes, as ``torchrun --nproc_per_node N -m moeify convert ...`` starts it.

Every process runs the whole conversion on the same data with the same seed (calibration, partition and
evaluation are cheap next to training and come out identical), and the training loop splits each global
batch of ``batch_size`` windows among the processes: each computes the gradients of its share, weighted
by its share of the windows, and ``torch.distributed.all_reduce`` sums them, so every process takes the
same optimizer step as one process with the whole batch would (up to float summation order). A run's
result therefore does not depend on the process count. Only the main process (rank 0) writes checkpoints
and outputs. The backend is NCCL where the work device is a GPU, gloo on CPU.

Each process holds the whole model by default (replicated, as DDP does); ``init_from_env(..., fsdp=True)``
(``moeify convert --fsdp``) shards the weights, gradients and optimizer state over the processes while
training instead (``sharding.py``), with the same steps.

Noise a loss draws inside a step (ToMoE's Gumbel samples) is each window's own (``noise.py``), and
statistics of the whole batch (ToMoE's load balance and mask unions) are gathered from every process
(``gathered``), so ToMoE too trains to the one-process weights. LoRA dropout (off by default) is drawn
per process: such runs are equally valid but not bitwise the one-process run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


_fsdp = False


def init_from_env(device: str, fsdp: bool = False) -> None:
    """Join the process group that the launcher's environment describes (no-op for one process);
    ``fsdp``: shard what training holds over the processes instead of replicating it."""
    global _fsdp
    _fsdp = fsdp
    if not launched() or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")


def fsdp() -> bool:
    """Whether training shards the model over more than one process (``sharding.py``)."""
    return _fsdp and world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Whether this process writes (checkpoints, outputs) and prints."""
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum_(tensors: Iterable[Tensor]) -> None:
    """Sum every tensor over the processes, in place (no-op for one process)."""
    if not dist.is_initialized():
        return
    for tensor in tensors:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def all_reduce_gradients_(model: nn.Module) -> None:
    """Sum the gradients of ``model``'s trainable parameters over the processes. A process whose share of
    the batch was empty contributes zeros. Sharded parameters (DTensors) are skipped: FSDP has summed
    their gradients in the backward pass."""
    if not dist.is_initialized():
        return
    params = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    all_reduce_sum_(param.grad for param in params)


def gathered(tensor: Tensor) -> Tensor:
    """Every process's ``tensor``, stacked: (processes, *shape); differentiable. A loss that every process
    computes alike from the gathered statistics of the whole batch sends each process's slot the gradient
    weighted by that process's share; the backward pass adds them up in the slot's owner (the shares add
    to 1), so after the gradient sum each parameter has the gradient of the whole batch's loss."""
    if not dist.is_initialized():
        return tensor.unsqueeze(0)
    return torch.stack(dist_nn.all_gather(tensor))
