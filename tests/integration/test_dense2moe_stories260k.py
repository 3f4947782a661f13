"""Dense2MoE on the real stories260K checkpoint with the DEFAULT fine-tuning budget (one removed layer,
top-1, 100 steps of 4 x 512 tokens at lr 1e-3), evaluated on held-out TinyStories text.

About 17 s per variant on this 2-core CPU when nothing else runs on it. Measured when written (seed 0):
``lfuc`` 8.83, ``prune_upcycle`` 8.94, ``prune_only`` 8.93 (dense 4.648); at top-2 ``lfuc`` 8.07 against
``prune_upcycle`` 8.93. At top-1 Table 5's direction holds at the defaults, but by about 1 %: the
router sends almost every token to the kept layer's MLP (one MLP replaces the other for a token, and
on this model the removed layer's MLP is rarely the better one). The margin is not robust to the
learning rate: at lr 3e-4 the three variants tie within 1 % (seeds 0/1/2: lfuc 7.91/7.82/7.93,
prune_upcycle 7.85/7.86/7.90, prune_only 7.91/7.87/7.96), at the paper's 1e-4 lfuc is last (8.39
against 8.04/8.14, seed 0). Top-2, where the fused MLP runs beside the kept one, is the decisive case.
Several seeds and the other choices tried: ``benchmarks/bench_dense2moe.py``."""

import pytest

import moeify

pytestmark = pytest.mark.slow  # the real stories260K checkpoint, held-out evaluation

VARIANTS = ("lfuc", "prune_upcycle", "prune_only")


def convert(held_out, **options):
    return moeify.convert(None, "dense2moe", options, eval=held_out, measure_speed=False).record


def test_at_the_default_budget_layer_fusion_upcycling_beats_both_baselines(held_out):
    runs = {variant: convert(held_out, variant=variant) for variant in VARIANTS}
    for record in runs.values():  # the method's defaults: one layer removed, top-1, 100 steps
        config = record["config"]
        assert (config["prune_layers"], config["top_k"], config["steps"], config["lr"]) == (None, 1, 100, 1e-3)
        [selection] = record["details"]["selection"]  # the paper's share of 5 layers: one, in one span
        assert record["details"]["finetune"]["steps"] == 100 and selection["removed"] == [2]
        assert record["active"]["apr"] == pytest.approx(0.8)  # 4 of 5 attentions, 1 of 5 MLPs not run
    ppl = {variant: record["metrics"]["ppl"] for variant, record in runs.items()}
    print("top-1 perplexity:", ppl, "dense:", runs["lfuc"]["metrics"]["dense_ppl"])
    assert ppl["lfuc"] < ppl["prune_upcycle"] and ppl["lfuc"] < ppl["prune_only"], ppl
    assert runs["lfuc"]["active"]["active_params"] == runs["prune_upcycle"]["active"]["active_params"]
    assert runs["lfuc"]["metrics"]["dense_ppl"] < ppl["lfuc"]
    [load] = [entry["load"] for entry in runs["lfuc"]["routing"]]
    assert len(load) == 2 and load[0] > 0.9 * sum(load)  # the kept layer's MLP takes almost every token


def test_at_top_2_the_fused_mlp_runs_beside_the_kept_one_and_wins_clearly(held_out):
    runs = {variant: convert(held_out, variant=variant, top_k=2) for variant in ("lfuc", "prune_upcycle")}
    ppl = {variant: record["metrics"]["ppl"] for variant, record in runs.items()}
    print("top-2 perplexity:", ppl)
    assert ppl["lfuc"] < 0.95 * ppl["prune_upcycle"], ppl
    assert runs["lfuc"]["active"]["apr"] == pytest.approx(runs["prune_upcycle"]["active"]["apr"])
    assert runs["lfuc"]["active"]["apr"] > 0.9  # both MLPs run: only the removed attention is saved
