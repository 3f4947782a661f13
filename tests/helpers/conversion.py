"""Copying a model before converting it, and the CPU conversion context the unit tests use."""

from __future__ import annotations

import copy

import torch

from moeify.calibration.data import TextSource
from moeify.methods import ConversionContext


def clone(model):
    """A deep copy of ``model`` in eval mode (the original stays the dense reference)."""
    return copy.deepcopy(model).eval()


def conversion_context(model, tokenizer, calib: TextSource, seed: int = 0) -> ConversionContext:
    """A method's context on ``model`` itself (converted in place): CPU, no progress bars."""
    return ConversionContext(model, tokenizer, calib, seed, torch.device("cpu"), progress=False)
