"""Dense2MoE on the real stories260K checkpoint, evaluated on held-out TinyStories text.

The full comparison at the default budget (top-1 and top-2, several seeds) is
``benchmarks/bench_dense2moe.py``, minutes per run; this test pins Table 5's direction where it is
decisive and quick: at top-2, with one removed layer, layer-fusion upcycling keeps the removed layer's
MLP working and beats both baselines after the same short fine-tuning."""

import pytest

import moeify


def test_layer_fusion_upcycling_beats_prune_and_upcycle_and_prune_only(held_out):
    budget = {"steps": "20", "warmup": "2", "top_k": "2", "calib_samples": "4"}
    runs = {variant: moeify.convert(None, "dense2moe", {**budget, "variant": variant}, eval=held_out,
                                    measure_speed=False).record
            for variant in ("lfuc", "prune_upcycle", "prune_only")}
    ppl = {variant: record["metrics"]["ppl"] for variant, record in runs.items()}
    assert ppl["lfuc"] < ppl["prune_upcycle"] and ppl["lfuc"] < ppl["prune_only"], ppl
    assert all(record["details"]["selection"]["removed"] == [2] for record in runs.values())
    assert runs["lfuc"]["active"]["active_params"] == runs["prune_upcycle"]["active"]["active_params"]
    assert runs["prune_only"]["active"]["apr"] == pytest.approx(0.8)
    assert runs["lfuc"]["metrics"]["dense_ppl"] < ppl["lfuc"]
