"""Where a model comes from (a folder, a GGUF file, a hub name or the embedded model), told from its name
and the file system alone: no torch, so commands that need no weights decide it at once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "embedded:stories260K"
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``path`` (a folder or hub name) and, for GGUF, the file inside it."""

    path: str
    gguf_file: str | None = None

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``from_pretrained`` needs besides the path."""
        return {} if self.gguf_file is None else {"gguf_file": self.gguf_file}

    def __str__(self) -> str:
        return self.path if self.gguf_file is None else str(Path(self.path) / self.gguf_file)


def model_source(model: str | Path | None) -> ModelSource:
    """The source behind ``model``; None (or ``EMBEDDED_MODEL``) is the embedded stories260K. A ``.gguf``
    file, or a folder whose only model file is one, is read as GGUF."""
    if model is None or str(model) == EMBEDDED_MODEL:
        return ModelSource(str(resources.files("moeify.data").joinpath("stories260K")))
    path = Path(model)
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"{str(path)!r}: no such GGUF file")
        return ModelSource(str(path.parent), path.name)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
        if len(ggufs) > 1:
            raise ValueError(f"{str(path)!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); name the one to load")
        if ggufs:
            return ModelSource(str(path), ggufs[0])
        raise ValueError(f"{str(path)!r} is not a model folder: it has no config.json (nor a .gguf file)")
    if not path.exists() and _looks_local(str(model)):
        raise FileNotFoundError(f"{str(model)!r}: no such model folder or file")
    return ModelSource(str(model))


def _looks_local(name: str) -> bool:
    """A path rather than a hub name ("org/name"): absolute, relative with ./ or ../, ~, deeper, or one whose
    first part exists here (``runs/cmeo`` beside a ``runs`` folder is a mistyped run, not a hub model)."""
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
            or "/" in name and Path(name.split("/", 1)[0]).exists())


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads from ``folder`` (the Hugging Face layout): those its index names,
    or model.safetensors; not any other, such as the consolidated.safetensors some releases ship beside them."""
    if (folder / INDEX_FILE).is_file():
        shards = set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values())
        return [folder / name for name in sorted(shards)]
    return [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else []
