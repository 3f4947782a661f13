"""Loading models: a converted folder (moeify's native format), a dense local folder or hub name, a GGUF
file (or a folder holding exactly one), or the embedded default. Below the use cases, so that every one
of them (convert, evaluate, export, analyze, compare) loads the same way.

GGUF files load through transformers' own GGUF reader (the ``gguf`` package): weights dequantised to the
working dtype (float32), tokenizer from the file. transformers marks such a model as quantised and refuses to
save it, although its weights are ordinary float tensors by then; moeify removes that marker, so a
conversion of a GGUF model saves like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel

from moeify.export.native import is_native_folder, load_native

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
    return ModelSource(str(model))


def check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use --device cpu")


def load_config(model: str | Path | None) -> PreTrainedConfig:
    """The model's config without its weights (for validation before any heavy work)."""
    source = model_source(model)
    with _gguf_errors(source):
        return AutoConfig.from_pretrained(source.path, **source.kwargs)


def load(path: str | Path, device: str = "cpu") -> PreTrainedModel:
    """Load a folder written by ``save`` (moeify's native format) with moeify's runtime classes."""
    return load_native(Path(path), device)


def load_model(model: str | Path | None = None, device: str = "cpu") -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) from a converted folder, a dense local folder or hub name, a GGUF file, or the
    embedded default (``None``)."""
    check_device(device)
    source = model_source(model)
    if source.gguf_file is not None:
        return _load_gguf(source, device)
    # Converted folders carry an auto_map for the model only; their tokenizer is the base model's.
    tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False)
    if Path(source.path).is_dir() and is_native_folder(Path(source.path)):
        return load_native(Path(source.path), device), tokenizer
    dense = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return dense.to(device).eval(), tokenizer


def _load_gguf(source: ModelSource, device: str) -> tuple[PreTrainedModel, Any]:
    """The GGUF model dequantised to float32 and its tokenizer; the model's quantisation marker removed
    (its weights are plain float tensors already: only the marker made ``save_pretrained`` refuse)."""
    with _gguf_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(source.path, **source.kwargs)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **source.kwargs)
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.config.name_or_path = str(source)
    return model.to(device).eval(), tokenizer


@contextmanager
def _gguf_errors(source: ModelSource) -> Iterator[None]:
    """A GGUF file the reader cannot parse, or of an architecture transformers does not map, as one
    ``ValueError`` naming the file (the reader raises whatever its parser meets: struct, key, value errors)."""
    if source.gguf_file is None:
        yield
        return
    try:
        yield
    except Exception as error:
        detail = str(error).splitlines()[0] if str(error) else "no detail"
        raise ValueError(f"{source}: not a GGUF model transformers can read ({type(error).__name__}: {detail})") \
            from error
