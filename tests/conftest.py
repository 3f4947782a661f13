"""Shared fixtures: tiny models from configs, the embedded tokenizer and texts, and ../shared assets."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moeify.api import load_model
from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, read_text
from moeify.methods import ConversionContext

SHARED = Path(__file__).resolve().parents[2] / "shared" / "assets"


@pytest.fixture(scope="session")
def stories():
    """The embedded stories260K (model, tokenizer); tests must deepcopy the model before changing it."""
    return load_model(None)


@pytest.fixture(scope="session")
def tokenizer(stories):
    return stories[1]


@pytest.fixture(scope="session")
def calib_text():
    return read_text(EMBEDDED_CALIB)


@pytest.fixture(scope="session")
def eval_text():
    return read_text(EMBEDDED_EVAL)


@pytest.fixture()
def make_ctx(tokenizer, calib_text):
    def make(model, seed: int = 0) -> ConversionContext:
        return ConversionContext(model, tokenizer, calib_text, seed, torch.device("cpu"), progress=False)
    return make


@pytest.fixture(scope="session")
def shared_assets() -> Path:
    if not SHARED.is_dir():
        pytest.skip("../shared/assets is absent")
    return SHARED


def clone(model):
    return copy.deepcopy(model).eval()
