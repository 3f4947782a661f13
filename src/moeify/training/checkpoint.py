"""Resumable training checkpoints: tensors in safetensors, everything else in JSON, written atomically.

A checkpoint is a folder ``step-00000120/`` inside the run's checkpoint folder, holding

- ``model.safetensors``: the model's whole state (parameters and buffers, e.g. CMoE's balancing bias),
  tied weights once (``safetensors.torch.load_model`` reads it back); a sharded run's shards gathered;
- ``optimizer.safetensors``: every tensor of ``optimizer.state_dict()["state"]``, keyed
  ``"<param index>/<name>"``;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file
from torch import nn
from torch.distributed.tensor import DTensor

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


def latest_step(folder: Path) -> int | None:
    dirs = _step_dirs(Path(folder))
    return int(dirs[-1].name[len(_PREFIX):]) if dirs else None


def _rng_tensors(generator: torch.Generator) -> dict[str, torch.Tensor]:
    states = {"data": generator.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def _on_cpu(value: torch.Tensor) -> torch.Tensor:
    """A state tensor as a whole CPU tensor: a sharded one (a DTensor, ``sharding.py``) is gathered, a
    collective every process takes part in, one tensor at a time so no device holds more than one whole."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().contiguous()


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as CPU tensors, each tied tensor once (under its first name, as ``load_model``
    accepts)."""
    seen: set[int] = set()
    tensors = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            tensors[name] = _on_cpu(value)
    return tensors


def _split_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """optimizer.state_dict() -> (tensors for safetensors, JSON-able rest)."""
    full = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in full["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{name}"] = _on_cpu(value)
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": full["param_groups"], "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in rest["scalars"].items()}
    for key, value in tensors.items():
        index, name = key.split("/", 1)
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
    model_tensors = _model_tensors(model)
    optimizer_tensors, optimizer_rest = _split_optimizer(optimizer)
    if not write:
        return target
    with atomic_dir(target, overwrite=True) as tmp:
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


def load_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, fingerprint: dict[str, Any]) -> Resumed:
    """Restore the latest checkpoint in ``folder`` into the model, optimizer and generators."""
    dirs = _step_dirs(Path(folder))
    if not dirs:
        raise FileNotFoundError(f"resume was asked for, but {str(folder)!r} holds no checkpoint")
    path = dirs[-1]
    state = json.loads((path / "state.json").read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format_version={state.get('format_version')} is not supported")
    saved = state["fingerprint"]
    changed = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k)!r} -> {fingerprint.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume from {path}: the run differs from the checkpointed one ({diff})")
    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    optimizer.load_state_dict(_join_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"]))
    rng = load_file(str(path / "rng.safetensors"))
    generator.set_state(rng["data"])
    torch.set_rng_state(rng["torch_cpu"])
    cuda = [rng[f"torch_cuda_{i}"] for i in range(sum(k.startswith("torch_cuda_") for k in rng))]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    return Resumed(step=state["step"], log=state["log"], scaler=state.get("grad_scaler", {}))
