"""Every registered method's configuration checks itself when constructed, in Python as from the CLI:
frozen, every ranged field refused outside its range, non-finite numbers refused."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from moeify.methods import METHODS
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.random_split import RandomSplitConfig
from moeify.options import OptionError, build_config


def ranged_fields(config_cls: type) -> list[tuple[str, float]]:
    """(field, a value just outside its range) for every field with a range."""
    cases = []
    for f in dataclasses.fields(config_cls):
        low, high = f.metadata.get("low"), f.metadata.get("high")
        if low is not None:
            cases.append((f.name, low if f.metadata.get("low_open") else low - 1))
        if high is not None:
            cases.append((f.name, high + 1))
    return cases


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_defaults_construct_and_are_frozen(method):
    config = method.config_cls()
    field = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, getattr(config, field))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_out_of_range_values_are_refused_by_the_python_api(method):
    cases = ranged_fields(method.config_cls)
    assert cases, "every method has ranged options"
    for name, value in cases:
        with pytest.raises(OptionError, match=name):
            method.config_cls(**{name: value})


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_non_finite_numbers_are_refused(method):
    floats = [f.name for f in dataclasses.fields(method.config_cls) if isinstance(f.default, float)]
    for name in floats:
        with pytest.raises(OptionError, match=f"{name}=nan is not a finite number"):
            method.config_cls(**{name: float("nan")})


TRAINING_FREE = {"cmoe", "more", "static_prune", "random_split", "teal"}  # at their defaults


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_config_declares_its_calibration_and_training(method):
    """What the memory plan and the layer-by-layer refusal ask of a config, it answers itself: a method that
    converts layer by layer trains nothing at its defaults, and a fine-tune option turns a training on."""
    config = method.config_cls()
    model_config = SimpleNamespace(max_position_embeddings=4096, intermediate_size=64)
    windows, seq_len = config.calibration_windows(model_config)
    assert windows >= 0 and (seq_len >= 2 or windows == 0)
    training = config.training(model_config)
    assert (training is None) == (method.name in TRAINING_FREE)
    assert not (method.layer_by_layer and training is not None)
    if "finetune_steps" in {f.name for f in dataclasses.fields(config)}:
        tuned = config.training(model_config) if training else dataclasses.replace(
            config, finetune_steps=3, finetune_seq_len=128).training(model_config)
        assert tuned.lora and tuned.seq_len == 128


def test_a_shorthand_stands_for_its_options_and_is_not_kept():
    """CMoE's spec=S2A3E16 builds the config of num_shared=2, top_k=3, num_experts=16: the config holds each
    setting once (no spec field to fall out of step with them), and a bad shorthand names itself."""
    config = build_config(CmoeConfig, {"spec": "S2A3E16", "ka": "5"})
    assert config == CmoeConfig(num_shared=2, top_k=3, num_experts=16, ka=5)
    assert "spec" not in {f.name for f in dataclasses.fields(config)}
    assert build_config(CmoeConfig, {"spec": "none"}) == CmoeConfig()
    with pytest.raises(OptionError, match="spec='S1E8' must look like S1A1E8"):
        build_config(CmoeConfig, {"spec": "S1E8"})
    with pytest.raises(OptionError, match="top_k=9 must be <= the routed experts"):
        build_config(CmoeConfig, {"spec": "S1A9E8"})
    assert build_config(RandomSplitConfig, {"spec": "S1A1E8"}).partition == "random"
    assert not issubclass(RandomSplitConfig, CmoeConfig)  # a baseline shares the carving options, not a paper's
