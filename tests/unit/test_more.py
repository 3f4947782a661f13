"""MoRE: identity with every expert on (all families), statistics, clustering, budget, options."""

import numpy as np
import pytest
import torch

from moeify.arch import DecoderAdapter
from moeify.calibration.observers import CoActivation
from moeify.methods.more import MoreConfig
from moeify.methods.more.convert import convert
from moeify.methods.more.layer_budget import LayerShape, candidate_layers, solve_budget
from moeify.moe.accounting import activated_parameters, moe_layers
from moeify.moe.experts.spectral import bound_cluster_sizes, spectral_clusters, top_eigenvectors
from moeify.moe.routing import jsd_to_uniform
from moeify.options import OptionError, build_config
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, tiny_model

CALIB = {"calib_samples": "8", "seq_len": "64"}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_expert_on_reproduces_the_dense_mlp_and_model(family, make_ctx):
    dense = tiny_model(family, **STORIES_VOCAB)
    ctx = make_ctx(clone(dense))
    details = convert(ctx, build_config(MoreConfig, CALIB)).details
    layers = moe_layers(ctx.model)
    assert [d["layer"] for d in details["layers"]] == details["converted_layers"] and layers
    assert abs(details["pruning_rate_uniform"] - 0.2) <= 0.01
    assert 1 - activated_parameters(ctx.model, measured=False).apr == pytest.approx(details["pruning_rate_uniform"])
    adapter = DecoderAdapter(dense)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for info, layer in zip(details["layers"], layers):
            reference = adapter.mlp_module(info["layer"])(x)
            torch.testing.assert_close(layer.forward_all_experts(x), reference, atol=1e-5, rtol=1e-5)
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        assert (ctx.model(ids).logits - dense(ids).logits).abs().max() > 1e-4  # top-1 really skips petals
        for layer in layers:
            layer.router.set_option("top_k", layer.router.num_experts)
        torch.testing.assert_close(ctx.model(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)


def test_coactivation_statistics_match_a_direct_count():
    stats = CoActivation(hidden_size=3, width=5, k_act=2)
    h = torch.tensor([[5.0, -4, 0, 1, 0], [0, 1, -3, 2, 0], [1, 0, 0, 0, 9]])
    x = torch.arange(9.0).reshape(3, 3)
    stats.update(x[:2], h[:2])
    stats.update(x[2:], h[2:])
    assert stats.frequency.tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])  # sums to k_act
    assert stats.coactivation[0, 1] == pytest.approx(1 / 3) and stats.coactivation[2, 3] == pytest.approx(1 / 3)
    assert stats.coactivation[0, 4] == pytest.approx(1 / 3) and stats.coactivation[1, 2] == 0
    assert stats.squares.mean_x_sq.tolist() == pytest.approx((x ** 2).mean(0).tolist())


def test_spectral_clustering_recovers_planted_blocks_and_sizes_are_bounded():
    rng = np.random.default_rng(0)
    truth = np.repeat([0, 1, 2], [20, 12, 8])
    a = np.where(truth[:, None] == truth[None, :], 1.0, 0.05) * rng.uniform(0.8, 1.2, (40, 40))
    a = (a + a.T) / 2
    np.fill_diagonal(a, 0)
    a[39, :] = a[:, 39] = 0  # an isolated channel
    labels = spectral_clusters(a, 3, seed=0)
    for block in range(3):
        members = labels[:39][truth[:39] == block]
        assert len(set(members.tolist())) == 1
    bounded = bound_cluster_sizes(labels, a, 3, min_size=10, max_size=16)
    sizes = np.bincount(bounded, minlength=3)
    assert sizes.sum() == 40 and all(10 <= s <= 16 for s in sizes) and not all(10 <= s <= 16 for s in
                                                                              np.bincount(labels, minlength=3))
    with pytest.raises(ValueError, match="cannot hold 40 vertices in 3 clusters"):
        bound_cluster_sizes(labels, a, 3, min_size=14, max_size=20)


@pytest.mark.parametrize("n,r", [(300, 8), (5, 4)])  # Lanczos; the dense solver (ARPACK needs r < n - 1)
def test_top_eigenvectors_span_the_dense_solver_s_subspace(n, r):
    rng = np.random.default_rng(1)
    basis = np.linalg.qr(rng.standard_normal((n, n)))[0]
    values = np.concatenate([np.linspace(2.0, 1.5, r), rng.uniform(-1, 1, n - r)])  # r largest, apart
    a = (basis * values) @ basis.T
    vectors = top_eigenvectors(a.copy(), r, seed=0)
    dense = np.linalg.eigh(a)[1][:, -r:]
    assert vectors.shape == (n, r)
    np.testing.assert_allclose(np.linalg.svd(dense.T @ vectors, compute_uv=False), 1.0, atol=1e-8)
    np.testing.assert_array_equal(vectors, top_eigenvectors(a.copy(), r, seed=0))  # deterministic


def test_jsd_to_uniform():
    assert jsd_to_uniform([5, 5, 5, 5]) == pytest.approx(0.0)
    assert jsd_to_uniform([1, 0]) == pytest.approx(0.3112781, abs=1e-6)
    assert 0 < jsd_to_uniform([9, 1, 1, 1]) < jsd_to_uniform([1, 0, 0, 0]) <= 1


def test_layer_strategies_and_budget():
    assert candidate_layers("middle-deep", 32) == list(range(10, 32))
    assert candidate_layers("early-middle", 32) == list(range(0, 22))
    assert len(candidate_layers("uniform", 32)) == 22 and candidate_layers("uniform", 32)[-1] == 31
    assert candidate_layers("1,3", 5) == [1, 3]
    with pytest.raises(ValueError, match=r"indices must be in \[0, 4\]"):
        candidate_layers("1,7", 5)
    shapes = {i: LayerShape(172, 192) for i in range(5)}
    budget = solve_budget([1, 2, 3, 4], shapes, 4, 226560, 0.2, None)
    assert abs(budget.pruning_rate - 0.2) <= 0.01 and budget.layers == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"target_pr=0.6 cannot be reached .* allowed \(0, 0.4"):
        solve_budget([1, 2, 3, 4], shapes, 4, 226560, 0.6, None)
    small = solve_budget([1, 2, 3, 4], shapes, 4, 226560, 0.05, None)  # every candidate layer, a wider backbone
    assert small.layers == [1, 2, 3, 4] and abs(small.pruning_rate - 0.05) <= 0.01


@pytest.mark.parametrize("options,message", [
    ({"act_ratio": "1.5"}, r"act_ratio=1.5 is out of range; allowed: \(0.0, 1.0\]"),
    ({"act_ratio": "1"}, r"act_ratio=1.0 is out of range; allowed: \(0, 1\)"),
    ({"share_ratio": "0.3"}, r"set exactly one"),
    ({"target_pr": "0"}, r"target_pr=0.0 is out of range"),
    ({"variant": "petals"}, r"variant='petals' is not allowed; choose one of: full, backbone, random, random_petals, naive"),
])
def test_bad_options(options, message):
    with pytest.raises(OptionError, match=message):
        build_config(MoreConfig, options)


def test_model_dependent_errors(make_ctx):
    config = tiny_model("llama").config
    with pytest.raises(OptionError, match=r"num_experts=200 must be <= the non-shared channels \(87\)"):
        MoreConfig(num_experts=200).check(config)
    ctx = make_ctx(tiny_model("llama", **STORIES_VOCAB))
    with pytest.raises(ValueError, match="target_pr=0.9 cannot be reached"):
        convert(ctx, build_config(MoreConfig, {**CALIB, "target_pr": "0.9"}))


@pytest.mark.parametrize("variant", ["backbone", "random", "random_petals", "naive"])
def test_variants_build_and_match_the_budget(variant, make_ctx):
    ctx = make_ctx(tiny_model("qwen2", **STORIES_VOCAB))
    details = convert(ctx, build_config(MoreConfig, {**CALIB, "variant": variant})).details
    assert abs(details["pruning_rate_uniform"] - 0.2) <= 0.01
    nominal = 1 - activated_parameters(ctx.model, measured=False).apr
    assert abs(nominal - 0.2) <= 0.015
    layers = moe_layers(ctx.model)
    if variant == "backbone":
        assert all(layer.router is None and not layer.experts for layer in layers)
    if variant == "naive":
        assert all(layer.shared is None for layer in layers)
    if variant == "random":  # MoRE-Random: MoRE's petals, tokens routed at random
        assert all(layer.router.kind == "random" for layer in layers)
        full = make_ctx(tiny_model("qwen2", **STORIES_VOCAB))
        convert(full, build_config(MoreConfig, CALIB))
        # the first converted layer sees the same inputs: the same petals (later ones see other inputs)
        assert layers[0].spec()["expert_widths"] == moe_layers(full.model)[0].spec()["expert_widths"]


def test_random_routing_ignores_the_experts_and_is_deterministic_per_token():
    from moeify.runtime.routers import RandomRouter

    router = RandomRouter(16, 4)
    router.directions.copy_(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(400, 16, generator=torch.Generator().manual_seed(1))
    first, again = router(x), router(x)
    assert torch.equal(first.expert, again.expert) and torch.equal(first.token, again.token)
    assert first.counts.min() > 50  # every petal gets a share of the tokens
    assert torch.equal(router.linear_form().weight, router.directions.double())


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_save_load_identical_logits_and_eval_cli(family, make_ctx, tokenizer, tmp_path):
    import json

    import moeify
    from moeify.api import ConversionResult
    from moeify.cli.main import main

    ctx = make_ctx(tiny_model(family, **STORIES_VOCAB))
    convert(ctx, build_config(MoreConfig, CALIB))
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "more"}), tmp_path / "more")
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(moeify.load(out)(ids).logits, ctx.model(ids).logits)
    assert main(["eval", str(out), "--seq-len", "128", "--json", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["ppl"]["tinystories_eval"] > 1 and 0 < result["active"]["apr"] < 1


def test_channels_never_in_a_tokens_top_k_act_are_counted_per_layer(make_ctx):
    """App. D.2, Table 4: the channels no calibration token had among its top-k_act activations."""
    stats = CoActivation(4, 6, k_act=2)
    h = torch.tensor([[5.0, 4.0, 0.1, 0.0, 0.2, 0.0], [0.3, 6.0, 7.0, 0.0, 0.1, 0.0]])
    stats.update(torch.zeros(2, 4), h)
    assert stats.never_activated == 3  # channels 3, 4, 5; 0, 1, 2 were in some token's top-2
    ctx = make_ctx(clone(tiny_model("llama", **STORIES_VOCAB)))
    details = convert(ctx, build_config(MoreConfig, CALIB)).details
    for layer in details["layers"]:
        m = DecoderAdapter(ctx.model).mlp_module(layer["layer"]).dense_width
        assert layer["k_act"] == max(1, int(0.05 * m)) and 0 <= layer["never_activated"] < m
