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


EMBEDDED_PARAGRAPHS = 567  # tinystories_calib.txt + tinystories_eval.txt are paragraphs [0, 567) of the dev file


@pytest.fixture(scope="session")
def held_out(shared_assets, tmp_path_factory) -> Path:
    """600 TinyStories paragraphs from ../shared that are in neither embedded slice (never calibrated on)."""
    text = (shared_assets / "data" / "tinystories" / "tinystories_valid_dev.txt").read_text()
    paragraphs = text.split("\n\n")[EMBEDDED_PARAGRAPHS:]
    path = tmp_path_factory.mktemp("heldout") / "tinystories_heldout.txt"
    path.write_text("\n\n".join(paragraphs[:600]))
    return path
