"""Shared fixtures: the embedded stories260K model, tokenizer and texts, conversion contexts, and the
../shared assets. Plain helpers (tiny models, ``clone``, constants) live in ``tests/helpers/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeify.api import load_model
from moeify.calibration.data import EMBEDDED_CALIB, EMBEDDED_EVAL, read_text
from moeify.methods import ConversionContext
from tests.helpers.conversion import conversion_context
from tests.helpers.data import SHARED, write_held_out


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
    """``make_ctx(model, seed=0)``: a CPU conversion context on ``model`` with the embedded tokenizer and
    calibration slice."""
    def make(model, seed: int = 0) -> ConversionContext:
        return conversion_context(model, tokenizer, calib_text, seed)
    return make


@pytest.fixture(scope="session")
def shared_assets() -> Path:
    if not SHARED.is_dir():
        pytest.skip("../shared/assets is absent")
    return SHARED


@pytest.fixture(scope="session")
def held_out(shared_assets, tmp_path_factory) -> Path:
    """600 TinyStories paragraphs from ../shared that are in neither embedded slice (never calibrated on)."""
    return write_held_out(shared_assets, tmp_path_factory.mktemp("heldout"), 600)
