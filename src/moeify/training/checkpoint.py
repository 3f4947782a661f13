"""Resumable training checkpoints: tensors in safetensors, everything else in JSON, written atomically.

A checkpoint is a folder ``step-00000120/`` inside the run's checkpoint folder, holding

- ``model.safetensors``: the model's whole state (parameters and buffers, e.g. CMoE's balancing bias),
  tied weights once; a sharded run's shards gathered. A resume copies it back in place a tensor at a time
  from the memory-mapped file, into a sharded model's shards directly (each process its own slice), so
  it never needs memory for the whole model beside the one training;
- ``optimizer.safetensors``: every tensor of ``optimizer.state_dict()["state"]``, keyed
  ``"<param index>/<name>"`` (restored the same way, a sharded parameter's moments cut like it);
- ``rng.safetensors``: the state of the data generator and of torch's global CPU (and CUDA) generators;
- ``state.json``: the step, the loss log so far, the optimizer's ``param_groups`` and non-tensor state,
  the float16 loss scaler's state (``precision.py``), and the run's fingerprint (the options that must
  match for a resume to continue the same run).

No pickle is involved (``torch.save`` of an optimizer state dict would be one). The folder is written
under a temporary name and renamed into place when complete (``atomic_dir``), so a process killed while
writing leaves the previous checkpoint as the latest; older checkpoints are removed after a new one is
complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moeify.files import atomic_dir

FORMAT_VERSION = 1
_PREFIX = "step-"


@dataclass(frozen=True)
class Resumed:
    """What a loaded checkpoint says beyond the tensors it restored."""

    step: int
    log: dict[str, Any]
    scaler: dict[str, Any]


def _step_dirs(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders start with a dot and are never listed)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def last_checkpoint(work_dir: Path, only: str | None = None) -> Path | None:
    """The latest complete checkpoint of the runs kept in ``work_dir`` (a checkpoint folder per run; ``only``:
    of the run in that folder), if any."""
    dirs = [d for run in Path(work_dir).glob(only or "*") if run.is_dir() for d in _step_dirs(run)]
    return max(dirs, key=lambda p: int(p.name[len(_PREFIX):]), default=None)


def latest_step(folder: Path) -> int | None:
    dirs = _step_dirs(Path(folder))
    return int(dirs[-1].name[len(_PREFIX):]) if dirs else None


def _rng_tensors(generator: torch.Generator) -> dict[str, torch.Tensor]:
    states = {"data": generator.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def _gathered(tensors: dict[str, Tensor], keep: bool) -> dict[str, Tensor]:
    """Each tensor whole on the CPU. A sharded one (a DTensor, ``sharding.py``) is gathered, a collective
    every process takes part in, one tensor at a time so no device holds more than one whole; ``keep=False``
    (a process that does not write) drops each at once, so it never holds the whole state beside its shards."""
    out = {}
    for name, value in tensors.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[name] = value.detach().cpu().contiguous()
    return out


def _unique_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's state (parameters and buffers, sharded ones as DTensors), each tied tensor once, under
    its first name."""
    seen: set[int] = set()
    state = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            state[name] = value
    return state


def _sharded_like(value: Tensor, param: DTensor) -> DTensor:
    """A whole tensor cut like ``param``'s shards: each process keeps its own slice, with no communication
    (every process reads the same checkpoint)."""
    return distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


def _restore_model_(model: nn.Module, path: Path) -> None:
    """Copy the checkpoint's tensors into the model's, in place and one tensor at a time (read from the
    memory-mapped file): a sharded model takes each process's slice only, so resuming never holds the whole
    model or a second copy of it."""
    state = _unique_state(model)
    with safe_open(str(path), framework="pt", device="cpu") as file:
        saved = set(file.keys())
        if saved != set(state):
            raise ValueError(f"{path}: the checkpoint does not hold this model (missing: "
                             f"{sorted(set(state) - saved)[:5]}, unexpected: {sorted(saved - set(state))[:5]})")
        with torch.no_grad():
            for name, target in state.items():
                value = file.get_tensor(name)
                target.copy_(_sharded_like(value, target) if isinstance(target, DTensor) else value)


def _split_optimizer(optimizer: torch.optim.Optimizer, keep: bool) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """optimizer.state_dict() -> (tensors for safetensors, JSON-able rest); ``keep``: as ``_gathered``."""
    full = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in full["state"].items():
        for name, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"{index}/{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    return _gathered(tensors, keep), {"param_groups": full["param_groups"], "scalars": scalars}


def _restored_optimizer(path: Path, optimizer: torch.optim.Optimizer, rest: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict of a checkpoint, read one tensor at a time; the state of a sharded parameter
    that holds a value per element (AdamW's moments, not its step) is cut like the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's index order
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in rest["scalars"].items()}
    with safe_open(str(path), framework="pt", device="cpu") as file:
        for key in file.keys():
            index, name = key.split("/", 1)
            value, param = file.get_tensor(key), params[int(index)]
            if isinstance(param, DTensor) and value.shape == param.shape:
                value = _sharded_like(value, param)
            state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def save_checkpoint(folder: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, log: dict[str, Any], fingerprint: dict[str, Any],
                    scaler: dict[str, Any] | None = None, write: bool = True) -> Path:
    """Write the checkpoint of ``step`` atomically and remove the older ones; ``scaler``: the loss
    scaler's state, if any. Every process of a sharded run calls it (the shards are gathered); only the one
    with ``write`` writes."""
    folder = Path(folder)
    target = folder / f"{_PREFIX}{step:08d}"
    model_tensors = _gathered(_unique_state(model), keep=write)
    optimizer_tensors, optimizer_rest = _split_optimizer(optimizer, keep=write)
    if not write:
        return target
    with atomic_dir(target, overwrite=True, command="checkpoint") as tmp:
        save_file(model_tensors, str(tmp / "model.safetensors"))
        save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"))
        save_file(_rng_tensors(generator), str(tmp / "rng.safetensors"))
        state = {"format_version": FORMAT_VERSION, "step": step, "log": log, "optimizer": optimizer_rest,
                 "grad_scaler": scaler or {}, "fingerprint": fingerprint}
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    for old in _step_dirs(folder):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


@contextmanager
def _damaged(path: Path) -> Iterator[None]:
    """A checkpoint file that cannot be read (truncated by a full disk, a partial copy) as one ``ValueError``
    naming the step folder and what to do."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - json, safetensors and torch raise many types; all mean "damaged"
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: the checkpoint cannot be read ({type(error).__name__}: {detail}); delete this "
                         "folder to resume from the checkpoint before it, or start again") from error


def load_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, fingerprint: dict[str, Any]) -> Resumed:
    """Restore the latest checkpoint in ``folder`` into the model, optimizer and generators."""
    dirs = _step_dirs(Path(folder))
    if not dirs:
        raise FileNotFoundError(f"resume was asked for, but {str(folder)!r} holds no checkpoint")
    path = dirs[-1]
    with _damaged(path):
        state = json.loads((path / "state.json").read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format_version={state.get('format_version')} is not supported")
    saved = state["fingerprint"]
    changed = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k)!r} -> {fingerprint.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume from {path}: the run differs from the checkpointed one ({diff})")
    with _damaged(path):
        _restore_model_(model, path / "model.safetensors")
        optimizer.load_state_dict(_restored_optimizer(path / "optimizer.safetensors", optimizer, state["optimizer"]))
        rng = load_file(str(path / "rng.safetensors"))
    generator.set_state(rng["data"])
    torch.set_rng_state(rng["torch_cpu"])
    cuda = [rng[f"torch_cuda_{i}"] for i in range(sum(k.startswith("torch_cuda_") for k in rng))]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    return Resumed(step=state["step"], log=state["log"], scaler=state.get("grad_scaler", {}))
