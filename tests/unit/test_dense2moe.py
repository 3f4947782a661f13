"""Dense2MoE: selection, norm folding, router, layer removal on every family (KV-cache generation, save ->
load), activated parameters checked by hand, variants, options."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import ConversionResult
from moeify.arch import DecoderAdapter
from moeify.arch.mlp import MlpWeights
from moeify.calibration.similarity import mean_cosine_matrix
from moeify.methods.dense2moe import Dense2moeConfig
from moeify.methods.dense2moe.build import Span, expert_sources, fold_mlp_norm, rank_spans, select_span, select_spans
from moeify.methods.dense2moe.config import span_sizes
from moeify.methods.dense2moe.convert import convert
from moeify.moe.accounting import activated_parameters, moe_layers
from moeify.options import OptionError, build_config
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import SoftmaxTopKRouter
from tests.helpers.conversion import assert_cached_generation_equals_uncached, clone
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, tiny_model

FAST = {"calib_samples": 4, "seq_len": 64, "steps": 0, "warmup": 0}
IDS = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(5))


def five_layers(family: str):
    return tiny_model(family, num_hidden_layers=5, **STORIES_VOCAB)


S_L = [[1.0, 0.9, 0.7, 0.5], [0.9, 1.0, 0.95, 0.8], [0.7, 0.95, 1.0, 0.85], [0.5, 0.8, 0.85, 1.0]]
S_M = [[1.0, 0.9, 0.8, 0.6], [0.9, 1.0, 0.6, 0.5], [0.8, 0.6, 1.0, 0.95], [0.6, 0.5, 0.95, 1.0]]


def test_the_similarity_matrix_is_the_mean_per_token_cosine():
    """Eq. 4-5: S[l][m] = mean over tokens of cos(x_t^(l), x_t^(m)), symmetric with a unit diagonal."""
    generator = torch.Generator().manual_seed(0)
    units = [torch.nn.functional.normalize(torch.randn(50, 8, generator=generator), dim=-1) for _ in range(4)]
    expected = torch.tensor([[float((a * b).sum(-1).mean()) for b in units] for a in units])
    matrix = mean_cosine_matrix(units)
    torch.testing.assert_close(matrix, expected)
    assert torch.equal(matrix, matrix.T) and torch.allclose(matrix.diagonal(), torch.ones(4))


def test_spans_ranked_by_layer_output_similarity_and_delta_read_as_a_distance():
    ranked = rank_spans(S_L, S_M)
    assert [(s.layer, s.n) for s in ranked[:3]] == [(1, 1), (0, 1), (2, 1)]
    # (1, 1) has S_L 0.95 but its MLP inputs are at distance 0.4; (0, 1) is the first within 0.3
    assert select_span(S_L, S_M, 0.3, None) == Span(0, 1, 0.9, pytest.approx(0.1))
    assert select_span(S_L, S_M, 0.5, None).layer == 1  # a looser delta takes the most similar span
    two = select_span(S_L, S_M, 0.3, 2)  # (0, 2): S_L 0.7, distances 0.1 and 0.2: every fused layer counts
    assert (two.layer, two.n, two.removed) == (0, 2, [1, 2]) and two.mlp_input_distance == pytest.approx(0.2)
    with pytest.raises(OptionError, match=r"delta=0.15: no span of 2 layers .* closest is 0.2000 .* raise delta"):
        select_span(S_L, S_M, 0.15, 2)


def test_the_default_count_is_the_papers_share_and_spans_do_not_touch():
    assert [Dense2moeConfig().layers_to_prune(tiny_model("llama", num_hidden_layers=n).config)
            for n in (2, 5, 24, 30)] == [1, 1, 5, 6]
    assert span_sizes(5, 2) == [3, 2] and span_sizes(4, 4) == [1, 1, 1, 1]
    # (0, 1) is the first pair within delta 0.3; the next must not touch layers 0-1: (2, 1), at distance 0.05
    spans = select_spans(S_L, S_M, 0.3, [1, 1])
    assert [(s.layer, s.n) for s in spans] == [(0, 1), (2, 1)]
    with pytest.raises(OptionError, match=r"no span of 1 layers is left beside .* \(layers \[1, 2\]\)"):
        select_spans(S_L, S_M, 0.5, [1, 1])  # (1, 1) first: every other pair touches layer 1 or 2


def test_several_spans_each_fused_into_its_own_kept_layer(make_ctx):
    ctx = make_ctx(five_layers("llama"))
    details = convert(ctx, build_config(Dense2moeConfig, {**FAST, "prune_layers": 2, "spans": 2, "delta": 2.0})).details
    spans = details["selection"]
    assert len(spans) == 2 and all(s["n"] == 1 for s in spans)
    kept = [s["layer"] for s in spans]
    removed = [layer for s in spans for layer in s["removed"]]
    assert not set(kept) & set(removed) and len(set(removed)) == 2
    assert ctx.model.config.num_hidden_layers == 3 and len(moe_layers(ctx.model)) == 2
    assert details["expert_sources"] == [[s["layer"], *s["removed"]] for s in spans]
    assert [r["index"] for r in details["removed_layers"]] == removed


def test_expert_sources_of_each_variant():
    span = Span(layer=1, n=2, layer_output_similarity=0.9, mlp_input_distance=0.1)
    assert expert_sources(span, "lfuc", 2, 3) == [1, 1, 2, 2, 2, 3, 3, 3]  # N of l*, M of each removed
    assert expert_sources(span, "prune_upcycle", 2, 3) == [1] * 8
    assert expert_sources(span, "prune_only", 2, 3) == []


@pytest.mark.parametrize("with_bias", [False, True])
def test_folding_a_removed_layers_norm_is_exact(with_bias):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mlp = MlpWeights(up=r(20, 8), down=r(8, 20), act="silu", gate=r(20, 8),
                     up_bias=r(20) if with_bias else None, gate_bias=r(20) if with_bias else None)
    kept = (1 + 0.3 * r(8), r(8) if with_bias else None)
    own = (1 + 0.3 * r(8), r(8) if with_bias else None)
    h = r(5, 8)
    n = h / h.pow(2).mean(-1, keepdim=True).sqrt()  # the normalisation both norms share
    affine = lambda norm: n * norm[0] + (0 if norm[1] is None else norm[1])  # noqa: E731
    folded = fold_mlp_norm(mlp, kept, own)
    torch.testing.assert_close(folded.forward(affine(kept)), mlp.forward(affine(own)), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mlp.forward(affine(kept)), mlp.forward(affine(own)), atol=1e-3)
    if with_bias:
        with pytest.raises(ValueError, match="the MLP has none"):
            fold_mlp_norm(MlpWeights(up=mlp.up, down=mlp.down, act="silu", gate=mlp.gate), kept, own)


def test_softmax_router_weights_and_identical_copies():
    router = SoftmaxTopKRouter(hidden_size=8, num_experts=4, top_k=2)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    torch.nn.init.zeros_(router.proj.weight)  # untrained: p uniform, the chosen weights sum to 1
    d = router(x)  # the dispatch carries p_i; the layer scales the experts' outputs by E / k
    assert router.expert_scale == 4 / 2
    assert d.counts.sum() == 20 and torch.allclose(d.weight * router.expert_scale, torch.full((20,), 0.5))
    torch.nn.init.normal_(router.proj.weight, generator=torch.Generator().manual_seed(2))
    d = router(x)
    probs = torch.softmax(x @ router.proj.weight.T, -1)
    torch.testing.assert_close(d.weight, probs[d.token, d.expert])  # p_i
    copy = torch.nn.Linear(8, 8)
    layer = MoeMLP([_expert_like(copy) for _ in range(4)], router)
    router.set_option("top_k", 1)
    y = layer(x)
    y.sum().backward()  # the router learns at top-1: p stays in the weight
    assert router.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, 4\]"):
        router.set_option("top_k", 5)


def _expert_like(linear):
    from moeify.runtime.experts import ExpertMLP

    expert = ExpertMLP(8, 8, "silu", gated=False, up_bias=True)
    expert.load_state_dict({"neurons.up.weight": linear.weight, "neurons.up.bias": linear.bias,
                            "down.weight": torch.eye(8)})
    return expert


def aligned(model):
    """``model`` with every parameter in freshly allocated memory. Loaded tensors can sit at unaligned
    offsets of the memory-mapped file, where BLAS takes another path for one-row products (an expert that
    got a single token) and rounds differently (~1e-7); with aligned copies the logits are bit-identical."""
    for param in model.parameters():
        param.data = param.data.clone()
    return model


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fused_model_generates_with_cache_and_reloads_identically(family, make_ctx, tokenizer, tmp_path):
    ctx = make_ctx(five_layers(family))
    details = convert(ctx, build_config(Dense2moeConfig, {**FAST, "prune_layers": 2, "delta": 2.0})).details
    model = ctx.model
    [span] = details["selection"]
    assert model.config.num_hidden_layers == 3 and details["expert_sources"] == [[span["layer"], *span["removed"]]]
    assert [m.self_attn.layer_idx if hasattr(m, "self_attn") else m.attention.layer_idx for m in
            DecoderAdapter(model).layers] == [0, 1, 2]
    assert_cached_generation_equals_uncached(model, IDS[:1, :6], 10)
    with torch.no_grad():
        expected = model(IDS).logits
    out = moeify.save(ConversionResult(model, tokenizer, {"method": "dense2moe"}), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    with torch.no_grad():
        loaded = moeify.load(out)
        assert torch.equal(aligned(loaded)(IDS).logits, expected)
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        assert torch.equal(aligned(remote)(IDS).logits, expected)
    assert activated_parameters(loaded) == activated_parameters(model, measured=False)


def test_activated_parameters_by_hand(make_ctx):
    dense = five_layers("llama")
    attn = 64 * 64 * 2 + 64 * 32 * 2  # q, o: 64 x 64; k, v: 64 x (2 heads x 16)
    mlp = 3 * 64 * 88
    assert activated_parameters(dense).total_params == 5 * (attn + mlp)
    results = {}
    for variant, top_k in (("lfuc", 1), ("lfuc", 2), ("prune_upcycle", 1), ("prune_only", 1)):
        ctx = make_ctx(clone(dense))
        convert(ctx, build_config(Dense2moeConfig, {**FAST, "variant": variant, "top_k": top_k}))
        results[variant, top_k] = activated_parameters(ctx.model, measured=False)
    for active in results.values():
        assert active.total_params == 5 * (attn + mlp)  # the dense model's, removed layer included
    assert results["lfuc", 1].active_params == 4 * attn + 4 * mlp  # one attention gone, top-1 of 2 MLPs
    assert results["lfuc", 2].active_params == 4 * attn + 5 * mlp  # both fused MLPs run
    assert results["lfuc", 1].apr == pytest.approx(0.8) and results["lfuc", 1].router_params == 64 * 2
    assert results["prune_upcycle", 1].active_params == 4 * attn + 4 * mlp
    assert results["prune_only", 1].active_params == 4 * attn + 4 * mlp and results["prune_only", 1].router_params == 0


def test_lfuc_experts_are_the_fused_mlps_and_prune_only_has_no_moe(make_ctx):
    dense = five_layers("qwen2")
    ctx = make_ctx(clone(dense))
    details = convert(ctx, build_config(Dense2moeConfig, {**FAST, "num_copies": 2})).details
    [selection] = details["selection"]
    l_star, (removed,) = selection["layer"], selection["removed"]
    layer = moe_layers(ctx.model)[0]
    assert details["expert_sources"] == [[l_star, l_star, removed]] and len(layer.experts) == 3
    src = DecoderAdapter(dense)
    h = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kept_in = src.mlp_norm_module(l_star)(h)
        torch.testing.assert_close(layer.experts[1](kept_in), src.mlp_module(l_star)(kept_in), atol=1e-5, rtol=1e-5)
        own_in = src.mlp_norm_module(removed)(h)  # Eq. 6: the removed layer's MLP, behind its own norm, on h
        torch.testing.assert_close(layer.experts[2](kept_in), src.mlp_module(removed)(own_in), atol=1e-5, rtol=1e-5)
    assert not torch.equal(layer.experts[0].neurons.up.weight, layer.experts[2].neurons.up.weight)
    only = make_ctx(clone(dense))
    convert(only, build_config(Dense2moeConfig, {**FAST, "variant": "prune_only"}))
    assert moe_layers(only.model) == [] and only.model.config.num_hidden_layers == 4


def test_options_fail_with_field_value_and_range():
    with pytest.raises(OptionError, match=r"delta=0.0 is out of range; allowed: \(0.0, 2.0\]"):
        build_config(Dense2moeConfig, {"delta": "0"})
    with pytest.raises(OptionError, match="top_k=4 must be <= the experts of the smallest span, .* = 3"):
        build_config(Dense2moeConfig, {"top_k": 4, "num_copies": 2}).check(five_layers("llama").config)
    with pytest.raises(OptionError, match="warmup=20 must be <= steps=5"):
        build_config(Dense2moeConfig, {"steps": 5, "warmup": 20})
    assert build_config(Dense2moeConfig, {"steps": 0}).warmup == 10  # "0: none" needs no warm-up change
    with pytest.raises(OptionError, match="variant='x' is not allowed"):
        build_config(Dense2moeConfig, {"variant": "x"})
    config = five_layers("llama").config
    with pytest.raises(OptionError, match=r"prune_layers=5 must be <= the layers less one kept layer per span \(4\)"):
        build_config(Dense2moeConfig, {"prune_layers": 5, "top_k": 1}).check(config)
    with pytest.raises(OptionError, match=r"prune_layers=4 must be <= the layers less one kept layer per span \(3\)"):
        build_config(Dense2moeConfig, {"prune_layers": 4, "spans": 2}).check(config)
    with pytest.raises(OptionError, match=r"spans=3 must be <= prune_layers"):
        build_config(Dense2moeConfig, {"prune_layers": 2, "spans": 3})
    with pytest.raises(OptionError, match=r"top_k=3 must be <= the experts of the smallest span, .* = 2"):
        build_config(Dense2moeConfig, {"prune_layers": 3, "spans": 2, "top_k": 3})
    build_config(Dense2moeConfig, {"variant": "prune_only", "top_k": 9}).check(config)  # no MoE: no bound


def test_paper_weighting_is_p_and_a_runtime_top_k_change_does_not_rescale():
    from moeify.runtime.routers import SoftmaxTopKRouter

    upcycle, paper = SoftmaxTopKRouter(8, 4, top_k=2), SoftmaxTopKRouter(8, 4, top_k=2, scale=1.0)
    assert (upcycle.expert_scale, paper.expert_scale) == (2.0, 1.0)
    upcycle.set_option("top_k", 1)
    assert upcycle.expert_scale == 2.0 and upcycle.spec()["scale"] == 2.0  # fixed at build, saved
    rebuilt = SoftmaxTopKRouter(8, **{k: v for k, v in upcycle.spec().items() if k != "kind"})
    assert rebuilt.expert_scale == 2.0 and rebuilt.top_k == 1


def test_the_free_search_takes_the_first_qualifying_span_of_any_length(make_ctx):
    """§2.3 with n* free (``search``): one span, the first in S_L order of any length whose fused MLP inputs
    are within delta; its length is the search's, not prune_layers'."""
    ctx = make_ctx(five_layers("llama"))
    details = convert(ctx, build_config(Dense2moeConfig, {**FAST, "search": True, "delta": 2.0})).details
    [span] = details["selection"]
    ranked = rank_spans(details["similarity"]["layer_output"], details["similarity"]["mlp_input"])
    assert (span["layer"], span["n"]) == (ranked[0].layer, ranked[0].n)  # delta 2 admits every span
    assert ctx.model.config.num_hidden_layers == 5 - span["n"]
    with pytest.raises(OptionError, match="search=true chooses n\\* itself, in one span: leave prune_layers"):
        build_config(Dense2moeConfig, {"search": True, "prune_layers": 2})
    with pytest.raises(OptionError, match="search=true"):
        build_config(Dense2moeConfig, {"search": True, "spans": 2})
