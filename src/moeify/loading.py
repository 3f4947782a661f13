"""Loading models: a converted folder (moeify's native format), a dense local folder or hub name, or the
embedded default. Below the use cases, so that every one of them (convert, evaluate, export, analyze,
compare) loads the same way."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from moeify.export.native import is_native_folder, load_native

EMBEDDED_MODEL = "embedded:stories260K"


def model_path(model: str | Path | None) -> str:
    """The folder or hub name behind ``model``; None (or ``EMBEDDED_MODEL``) is the embedded stories260K."""
    if model is None or str(model) == EMBEDDED_MODEL:
        return str(resources.files("moeify.data").joinpath("stories260K"))
    return str(model)


def check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use --device cpu")


def load(path: str | Path, device: str = "cpu") -> PreTrainedModel:
    """Load a folder written by ``save`` (moeify's native format) with moeify's runtime classes."""
    return load_native(Path(path), device)


def load_model(model: str | Path | None = None, device: str = "cpu") -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) from a converted folder, a dense local folder or hub name, or the embedded
    default (``None``)."""
    check_device(device)
    path = model_path(model)
    # Converted folders carry an auto_map for the model only; their tokenizer is the base model's.
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if Path(path).is_dir() and is_native_folder(Path(path)):
        return load_native(Path(path), device), tokenizer
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return dense.to(device).eval(), tokenizer
