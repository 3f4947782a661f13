"""Golden values: every registered method converts one fixed tiny random LLaMA, and a few numbers of the
result must match the ones stored in ``tests/helpers/golden.json``.

The numbers: the sum and the largest absolute value of the converted model's float32 logits on a fixed
token batch (under ``torch.no_grad``), and the nominal and the measured (on that batch) activated-parameter
ratios. They catch any change of a method's output, e.g. in a refactoring that was meant to change none.
The method list comes from the registry (``moeify.methods.METHODS``), so a newly registered method is
tested here too, with its default options unless ``FAST`` lists small ones for it; it fails until its
golden values are stored.

To write (or, after an intended change of a method's output, rewrite) the golden values, run

    MOEIFY_WRITE_GOLDEN=1 PYTHONPATH=src python -m pytest tests/unit/test_golden.py [-k METHOD]

which stores the numbers of the selected methods in ``tests/helpers/golden.json`` instead of checking
them (those tests report as skipped); review the diff of that file and commit it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moeify.methods import METHODS, Method
from moeify.moe.accounting import activated_parameters, nominal_activated_parameters, tracking_routing
from moeify.options import build_config
from tests.helpers.conversion import FAST, conversion_context
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model

GOLDEN = Path(__file__).resolve().parents[1] / "helpers" / "golden.json"
WRITE = os.environ.get("MOEIFY_WRITE_GOLDEN") == "1"
REL = 1e-5  # float32 sums and maxima; the ratios are checked as tightly

SEED = 0
IDS = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(7))  # ids of the embedded tokenizer


def golden_numbers(method: Method, tokenizer, calib_text) -> dict[str, object]:
    """Convert the fixed tiny LLaMA with ``method`` (its ``FAST`` options) and measure the golden numbers."""
    options = FAST.get(method.name, {})
    model = tiny_model("llama", seed=SEED, **STORIES_VOCAB)
    config = build_config(method.config_cls, options)
    method.check(config, model.config)
    with torch.random.fork_rng(devices=[]):  # a method drawing from the global RNG draws the same numbers
        torch.manual_seed(SEED)
        method.run(conversion_context(model, tokenizer, calib_text, SEED), config)
    model.eval()
    with torch.no_grad(), tracking_routing(model):
        logits = model(IDS).logits
    assert logits.dtype == torch.float32
    nominal = nominal_activated_parameters(model)
    return {
        "options": json.loads(json.dumps(options)),
        "logits_sum": float(logits.double().sum()),
        "logits_max_abs": float(logits.abs().max()),
        "nominal_apr": None if nominal is None else nominal.apr,
        "measured_apr": activated_parameters(model, measured=True).apr,
    }


def stored() -> dict[str, dict[str, object]]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}


def write(name: str, numbers: dict[str, object]) -> None:
    values = stored()
    values[name] = numbers
    GOLDEN.write_text(json.dumps(dict(sorted(values.items())), indent=2) + "\n")


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_conversion_matches_the_golden_values(method, tokenizer, calib_text):
    got = golden_numbers(method, tokenizer, calib_text)
    if WRITE:
        write(method.name, got)
        pytest.skip(f"MOEIFY_WRITE_GOLDEN=1: wrote {method.name}'s golden values to {GOLDEN}, checked nothing")
    how = (f"generate them with `MOEIFY_WRITE_GOLDEN=1 PYTHONPATH=src python -m pytest tests/unit/test_golden.py "
           f"-k {method.name}`, review the diff of tests/helpers/golden.json and commit it")
    expected = stored().get(method.name)
    if expected is None:
        pytest.fail(f"no golden values for method {method.name!r} in {GOLDEN}; {how}")
    assert got["options"] == expected["options"], \
        f"FAST[{method.name!r}] changed since the golden values were written; {how}"
    for key in ("logits_sum", "logits_max_abs", "nominal_apr", "measured_apr"):
        want = expected[key]
        assert (got[key] is None) == (want is None), (key, got[key], want)
        if want is not None:
            assert got[key] == pytest.approx(want, rel=REL), (method.name, key)


def test_golden_values_are_stored_for_registered_methods_only():
    unknown = set(stored()) - {m.name for m in METHODS}
    assert not unknown, f"{GOLDEN.name} holds golden values of unregistered methods {sorted(unknown)}: remove them"
