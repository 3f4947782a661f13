"""Every registered method's configuration checks itself when constructed, in Python as from the CLI:
frozen, every ranged field refused outside its range, non-finite numbers refused."""

from __future__ import annotations

import dataclasses

import pytest

from moeify.methods import METHODS
from moeify.options import OptionError


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
