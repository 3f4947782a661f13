"""Tensors of safetensors files read by name, a few at a time, without loading the rest of the checkpoint.

A checkpoint is ``model.safetensors`` or the shards an index (``model.safetensors.index.json``, the
Hugging Face layout) lists. Each read opens the files it needs, copies the tensors asked for out of
their memory maps and closes them, so no page of the other layers stays resident.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from moeify.sources import INDEX_FILE, SINGLE_FILE


class TensorFiles:
    """Where each tensor of a checkpoint is: ``{model's name: (safetensors file, name in the file)}``."""

    def __init__(self, files: dict[str, tuple[Path, str]]) -> None:
        self.files = dict(files)

    @classmethod
    def of_folder(cls, folder: Path, rename: Callable[[str], str] = str) -> TensorFiles:
        """The tensors of a checkpoint folder (one file, or the shards of its index), under the names
        ``rename`` gives the stored ones (transformers renames some families' tensors as it loads them)."""
        folder = Path(folder)
        if (folder / INDEX_FILE).is_file():
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            return cls({rename(name): (folder / file, name) for name, file in weight_map.items()})
        if (folder / SINGLE_FILE).is_file():
            with safe_open(folder / SINGLE_FILE, framework="pt") as f:
                stored = list(f.keys())  # noqa: SIM118 - a safe_open handle is no dict
            return cls({rename(name): (folder / SINGLE_FILE, name) for name in stored})
        raise ValueError(f"{folder}: no safetensors checkpoint ({SINGLE_FILE} or {INDEX_FILE}); layer-by-layer "
                         "loading reads safetensors files only")

    @classmethod
    def of_files(cls, files: dict[str, Path]) -> TensorFiles:
        """Tensors stored under the model's own names: ``{name: file}``."""
        return cls({name: (file, name) for name, file in files.items()})

    def names(self) -> set[str]:
        return set(self.files)

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The named tensors, copied out of their files (one open per file)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise ValueError(f"tensor {name!r} is not in the checkpoint; layer-by-layer loading needs a "
                                 "checkpoint whose tensor names are the model's own (as save_pretrained writes them)")
            by_file.setdefault(self.files[name][0], []).append(name)
        tensors: dict[str, Tensor] = {}
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in file_names:
                    tensors[name] = f.get_tensor(self.files[name][1]).clone()  # no view of the map outlives it
                    check_finite(name, tensors[name], file)
        return tensors


def check_finite(name: str, tensor: Tensor, source: object) -> None:
    """Refuse a weight that holds NaN or Inf (a damaged or overflowed checkpoint): every result computed from
    it would be NaN, found only after the work."""
    if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{source}: the weight {name} holds {bad} NaN or Inf value(s) of {tensor.numel()}; the "
                         "checkpoint is damaged: load it again from its source")


def write_tensors(tensors: dict[str, Tensor], path: Path) -> None:
    """One safetensors file of ``tensors`` (moved to the CPU, made contiguous), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, tmp,
              metadata={"format": "pt"})
    os.replace(tmp, path)


def write_index(weight_map: dict[str, str], total_bytes: int, folder: Path) -> None:
    """The shards' index, as ``save_pretrained`` writes it."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
