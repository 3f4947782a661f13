"""DSMoE on the real stories260K checkpoint with the DEFAULT training budget (200 steps of 8 x 256
tokens of the embedded training slice), evaluated on held-out TinyStories text from ../shared.

One default run takes about 20 s of training and 15 s of evaluation and analyses on this 2-core CPU
when nothing else runs on it (the file: 88 s; 15 minutes when the CPU is shared); it trains two models
(``full`` and ``no_ste``). Measured when written: ``full`` at tau = 0.5, APR 0.921, perplexity 5.98
(dense 4.648); ``no_ste`` at its own tau 0.5 APR 0.325, perplexity 33.8, and at tau 0.057, where it
activates APR 0.929, perplexity 22.0. The STE ablation over several sparsity
weights and the fine tau sweep are in ``benchmarks/bench_dsmoe.py``."""

import pytest

import moeify
from moeify.calibration.data import read_text
from moeify.methods.dsmoe.analysis import tau_sweep

pytestmark = pytest.mark.slow  # the real stories260K checkpoint, held-out evaluation


def test_untrained_conversion_with_every_gate_on_is_the_dense_model(held_out):
    record = moeify.convert(None, "dsmoe", {"steps": 0, "tau": 0.0, "analyses": False}, eval=held_out,
                            measure_speed=False).record
    assert record["metrics"]["ppl"] == pytest.approx(record["metrics"]["dense_ppl"], rel=1e-5)
    assert record["active"]["mlp_ratio"] == 1.0 and record["nominal_active"] is None


@pytest.fixture(scope="module")
def trained(held_out):
    return moeify.convert(None, "dsmoe", {}, eval=held_out, measure_speed=False)  # every default


def test_default_training_sparsifies_and_the_tau_sweep_is_monotone(trained):
    record = trained.record
    config, training = record["config"], record["details"]["training"]
    assert (config["steps"], config["batch_size"], config["variant"], config["tau"]) == (200, 8, "full", 0.5)
    assert training["steps"] == 200 and record["details"]["train_seq_len"] == 256
    sweep = {row["tau"]: row for row in record["details"]["analysis"]["tau_sweep"]}
    assert sorted(sweep) == [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]  # Appendix A, Table 4
    for key in ("model_ratio", "apr", "mlp_ratio"):  # a higher threshold never activates more
        ratios = [sweep[tau][key] for tau in sorted(sweep)]
        assert all(a >= b for a, b in zip(ratios, ratios[1:])) and ratios[0] > ratios[-1], (key, ratios)
    assert sweep[0.5]["apr"] == pytest.approx(record["active"]["apr"])
    assert sweep[0.5]["model_ratio"] == pytest.approx(record["paper_ratio"]["value"])  # Table 4's whole model
    assert sweep[0.5]["model_ratio"] > record["active"]["apr"]  # embeddings and head always active
    assert 0.5 < record["active"]["apr"] < 1 and 0 < record["active"]["mlp_ratio"] < 1  # tau = 0.5 drops experts
    assert record["metrics"]["dense_ppl"] < record["metrics"]["ppl"] < 2 * record["metrics"]["dense_ppl"]
    assert record["metrics"]["eval_tokens"] > 40_000


def test_straight_through_beats_no_ste_at_a_matched_activated_ratio(trained, held_out):
    """Table 3's direction: ``no_ste`` (Eq. 7, no straight-through estimator) trained with the same
    budget is evaluated at the highest tau (bisection) where it activates at least ``full``'s APR, and
    still has the higher perplexity."""
    full = trained.record
    no_ste = moeify.convert(None, "dsmoe", {"variant": "no_ste", "analyses": False}, eval=held_out,
                            measure_speed=False)
    assert no_ste.record["active"]["apr"] < full["active"]["apr"]  # gates below tau get no gradient back
    source, seq_len = read_text(held_out), full["metrics"]["eval"]["seq_len"]
    target = full["active"]["apr"]

    def at(tau):
        [row] = tau_sweep(no_ste.model, no_ste.tokenizer, [source], seq_len, (tau,))
        return row

    low, high, matched = 0.0, 0.5, at(0.0)  # tau = 0 switches every expert on
    assert matched["apr"] == pytest.approx(1.0)
    for _ in range(8):  # tau to within 0.5 / 2^8
        row = at((low + high) / 2)
        if row["apr"] >= target:
            low, matched = row["tau"], row
        else:
            high = row["tau"]
    own = no_ste.record
    print(f"full: APR {target:.4f} ppl {full['metrics']['ppl']:.3f}; no_ste at its own tau 0.5: APR "
          f"{own['active']['apr']:.4f} ppl {own['metrics']['ppl']:.3f}; at tau {matched['tau']:.4f}: "
          f"APR {matched['apr']:.4f} ppl {matched['ppl']:.3f}")
    assert target <= matched["apr"] < target + 0.03, (matched, target)
    assert matched["ppl"] > 2 * full["metrics"]["ppl"], (matched, full["metrics"]["ppl"])


def test_saved_model_reproduces_the_record(trained, held_out, tmp_path):
    out = moeify.save(trained, tmp_path / "dsmoe")
    model, tokenizer = moeify.load_model(out)
    results = moeify.evaluate(model, tokenizer, [held_out])
    assert results["ppl"][held_out.name] == pytest.approx(trained.record["metrics"]["ppl"], rel=1e-6)
    assert results["active"]["mlp_ratio"] == pytest.approx(trained.record["active"]["mlp_ratio"], rel=1e-9)
    assert (out / "dsmoe_activated_experts.png").is_file()
