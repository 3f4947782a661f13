"""Data-parallel training across processes, as ``torchrun --nproc_per_node N -m moeify convert ...`` starts it.

Every process runs the whole conversion on the same data with the same seed (calibration, partition and
evaluation are cheap next to training and come out identical), and the training loop splits each global
batch of ``batch_size`` windows among the processes: each computes the gradients of its share, weighted
by its share of the windows, and ``torch.distributed.all_reduce`` sums them, so every process takes the
same optimizer step as one process with the whole batch would (up to float summation order). A run's
result therefore does not depend on the process count. Only the main process (rank 0) writes checkpoints
and outputs. The backend is NCCL where the work device is a GPU, gloo on CPU.

Randomness drawn inside a training step (ToMoE's Gumbel noise, LoRA dropout) is drawn per process for
its share of the batch, so those runs are equally valid but not bitwise the one-process run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: str) -> None:
    """Join the process group that the launcher's environment describes (no-op for one process)."""
    if not launched() or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")


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
    the batch was empty contributes zeros."""
    if not dist.is_initialized():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    all_reduce_sum_(param.grad for param in params)
