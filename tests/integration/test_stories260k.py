"""CMoE on the real stories260K checkpoint, evaluated on held-out TinyStories text from ../shared
(the ``held_out`` fixture: paragraphs of the staged validation file after the embedded slices)."""

import pytest

import moeify

pytestmark = pytest.mark.slow  # the real stories260K checkpoint, held-out evaluation


@pytest.mark.parametrize("spec", ["S1A1E8", "S2A2E16"])
def test_training_free_cmoe_beats_random_split(held_out, spec):
    """The paper's Table I direction: CMoE's carving beats the LLaMA-MoE random split at equal S/A/E."""
    runs = {part: [moeify.convert(None, "cmoe", {"spec": spec, "partition": part}, eval=held_out, seed=seed,
                                  measure_speed=False).record for seed in (0, 1)]
            for part in ("balanced_kmeans", "random")}
    cmoe = max(r["metrics"]["ppl"] for r in runs["balanced_kmeans"])
    random = min(r["metrics"]["ppl"] for r in runs["random"])
    assert cmoe < random
    dense = runs["balanced_kmeans"][0]["metrics"]["dense_ppl"]
    assert dense < cmoe  # 25 % of the MLP costs quality without fine-tuning


def test_record_reports_activated_ratios_as_counted_by_hand(held_out):
    record = moeify.convert(None, "cmoe", {"spec": "S1A1E8"}, eval=held_out, measure_speed=False).record
    d, d_h, layers, kv = 64, 172, 5, 4 * 8
    attn = layers * (2 * d * d + 2 * d * kv)  # q, o: 64x64; k, v: 4 kv heads x head_dim 8
    mlp = layers * 3 * d * d_h
    # S1A1E8 on 172 neurons: sizes [22, 22, 22, 22, 21, 21, 21, 21]; shared = 22, routed = 3x22 + 4x21
    nominal_mlp = layers * 3 * d * (22 + (3 * 22 + 4 * 21) / 7)
    assert record["active"]["total_params"] == attn + mlp == 226560
    assert record["nominal_active"]["active_params"] == pytest.approx(attn + nominal_mlp)
    assert record["nominal_active"]["mlp_ratio"] == pytest.approx(nominal_mlp / mlp)
    # measured: a routed expert of 22 or 21 neurons per token -> between these bounds
    low, high = layers * 3 * d * (22 + 21) / mlp, layers * 3 * d * (22 + 22) / mlp
    assert low <= record["active"]["mlp_ratio"] <= high
    assert record["active"]["apr"] == pytest.approx(
        (attn + record["active"]["mlp_ratio"] * mlp) / (attn + mlp))
    assert record["metrics"]["eval_tokens"] > 40_000
