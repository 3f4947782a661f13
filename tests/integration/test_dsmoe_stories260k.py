"""DSMoE on the real stories260K checkpoint, evaluated on held-out TinyStories text from ../shared.

A short training run keeps this under a minute; the default budget and the STE ablation at matched
activated ratio are measured by benchmarks/bench_dsmoe.py (numbers in the README)."""

import pytest

import moeify

SHORT = {"steps": 40, "seq_len": 128}


def test_untrained_conversion_with_every_gate_on_is_the_dense_model(held_out):
    record = moeify.convert(None, "dsmoe", {"steps": 0, "tau": 0.0, "analyses": False}, eval=held_out,
                            measure_speed=False).record
    assert record["metrics"]["ppl"] == pytest.approx(record["metrics"]["dense_ppl"], rel=1e-5)
    assert record["active"]["mlp_ratio"] == 1.0 and record["nominal_active"] is None


@pytest.fixture(scope="module")
def trained(held_out):
    return moeify.convert(None, "dsmoe", SHORT, eval=held_out, measure_speed=False)


def test_training_sparsifies_and_the_tau_sweep_is_monotone(trained):
    record = trained.record
    sweep = {row["tau"]: row for row in record["details"]["analysis"]["tau_sweep"]}
    ratios = [sweep[tau]["mlp_ratio"] for tau in sorted(sweep)]
    assert all(a >= b for a, b in zip(ratios, ratios[1:])) and ratios[0] > ratios[-1]
    assert sweep[0.5]["mlp_ratio"] == pytest.approx(record["active"]["mlp_ratio"])
    assert 0 < record["active"]["mlp_ratio"] < 1  # tau = 0.5 switches experts off
    assert record["active"]["apr"] < 1
    assert record["details"]["training"]["steps"] == SHORT["steps"]
    assert record["metrics"]["eval_tokens"] > 40_000


def test_saved_model_reproduces_the_record(trained, held_out, tmp_path):
    out = moeify.save(trained, tmp_path / "dsmoe")
    model, tokenizer = moeify.load_model(out)
    results = moeify.evaluate(model, tokenizer, [held_out])
    assert results["ppl"][held_out.name] == pytest.approx(trained.record["metrics"]["ppl"], rel=1e-6)
    assert results["active"]["mlp_ratio"] == pytest.approx(trained.record["active"]["mlp_ratio"], rel=1e-9)
    assert (out / "dsmoe_activated_experts.png").is_file()
