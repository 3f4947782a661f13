"""ToMoE on the real stories260K checkpoint at active_ratio 0.5, evaluated on held-out TinyStories text."""

import json

import pytest

import moeify

pytestmark = pytest.mark.slow  # the real stories260K checkpoint, held-out evaluation


def test_tomoe_meets_the_budget_and_beats_static_pruning_at_the_same_activated_parameters(held_out, tmp_path):
    tomoe = moeify.convert(None, "tomoe", {"active_ratio": "0.5"}, eval=held_out, measure_speed=False)  # defaults
    record = tomoe.record
    assert record["active"]["apr"] == pytest.approx(0.5, abs=0.02)
    for attention in ("on", "off"):  # the baseline with and without head-dim pruning: ToMoE beats both
        baseline = moeify.convert(None, "static_prune", {"active_ratio": "0.5", "attention": attention},
                                  eval=held_out, measure_speed=False).record
        assert baseline["active"]["apr"] == pytest.approx(record["active"]["apr"], abs=0.02)
        assert record["metrics"]["ppl"] < baseline["metrics"]["ppl"], (attention, record["metrics"], baseline["metrics"])
    curves = record["details"]["training"]["curves"]
    assert {"kd", "r_p", "r_u", "r_l"} <= set(curves) and len(curves["kd"]) == 600
    out = moeify.save(tomoe, tmp_path / "tomoe")
    assert (out / "tomoe_training.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "record.json").read_text())
    assert saved["details"]["training"]["curves"]["r_p"] == curves["r_p"]
