"""``moeify export --approximate``: DSMoE's threshold router, ToMoE's per-token attention dimensions and
TEAL's input thresholds have no exact format; their closest forms are chosen on calibration text, and each
is exact where the original is already static (every gate above tau, every token keeping the same
dimensions, a zero threshold) — which pins that the approximation changes only what it must."""

import json

import pytest
import torch

import moeify
from moeify.api import ConversionResult
from moeify.cli.main import main
from moeify.export.approximate import approximate, most_common_count
from moeify.export.hf_export import EXACT_TOLERANCE, EXPORTERS
from moeify.methods.dsmoe import DsmoeConfig
from moeify.methods.dsmoe.convert import convert as dsmoe_convert
from moeify.methods.teal import TealConfig
from moeify.methods.teal.convert import convert as teal_convert
from moeify.methods.tomoe import TomoeConfig
from moeify.methods.tomoe.convert import convert as tomoe_convert
from moeify.options import build_config
from moeify.runtime.attention import PrunedAttention
from moeify.runtime.routers import ThresholdRouter
from moeify.runtime.sparse_inputs import ThresholdedLinear
from tests.helpers.conversion import FAST, clone, conversion_context

SEQ_LEN = 64


def _converted(stories, tokenizer, calib_text, method: str):
    ctx = conversion_context(clone(stories[0]), tokenizer, calib_text)
    if method == "dsmoe":
        dsmoe_convert(ctx, build_config(DsmoeConfig, FAST["dsmoe"]))
    elif method == "tomoe":
        tomoe_convert(ctx, build_config(TomoeConfig, {**FAST["tomoe"], "attention": "on"}))
    else:
        teal_convert(ctx, TealConfig(sparsity=0.5, calib_samples=4, seq_len=SEQ_LEN))
    return ctx.model


def _logit_gap(model, export) -> float:
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        return float((export(input_ids=ids).logits - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def dsmoe(stories, tokenizer, calib_text):
    return _converted(stories, tokenizer, calib_text, "dsmoe")


@pytest.fixture(scope="module")
def tomoe(stories, tokenizer, calib_text):
    return _converted(stories, tokenizer, calib_text, "tomoe")


@pytest.fixture(scope="module")
def teal(stories, tokenizer, calib_text):
    return _converted(stories, tokenizer, calib_text, "teal")


def test_no_format_takes_them_exactly_and_each_says_approximate_would(dsmoe, tomoe, teal):
    for model, fmt, words in ((dsmoe, "glm4_moe", "token-dependent set of experts"),
                              (tomoe, "qwen2_moe", "value/output head dimensions chosen per token"),
                              (teal, "llama", "zeroes projection inputs below a threshold")):
        support = EXPORTERS[fmt].supports(model, explain=True)
        assert not support and support.approximable and words in str(support) and "--approximate" in str(support)


def test_the_fixed_k_is_the_most_common_expert_count_not_the_mean():
    """One layer with its gates mostly off drags the mean below what the others run; the most common
    count reproduces the most tokens' expert sets."""
    def k(counts: list[int]) -> int:
        return most_common_count(torch.bincount(torch.tensor(counts), minlength=9))

    assert k([8] * 6 + [7] * 2 + [0] * 4) == 8  # mean 5.2
    assert k([0, 0, 0, 2, 3]) == 2  # at least one expert; ties: the smaller
    assert k([0, 0]) == 1


def test_dsmoe_threshold_router_becomes_its_own_gates_at_the_most_common_count(dsmoe, tokenizer, calib_text,
                                                                               eval_text):
    approximation, parts = approximate(dsmoe, tokenizer, calib_text, eval_text, steps=1, seq_len=SEQ_LEN)
    record = parts["threshold_routers"]
    shares = record["calib_count_shares"]  # index: experts per token, over every layer's calibration tokens
    assert len(shares) == 9 and sum(shares) == pytest.approx(1.0)
    assert record["top_k"] == 1 + max(range(8), key=lambda i: shares[1 + i])
    for path, routing in approximation.routings.items():
        router = dsmoe.get_submodule(path).router
        assert routing.weighting == "sigmoid" and routing.approximate and routing.top_k == record["top_k"]
        assert torch.equal(routing.weight, router.proj.weight.double())  # the top-k gates are the top-k scores x Y
        assert routing.expert_scale == pytest.approx(router.gate_scale * router.num_experts / record["top_k"])
    assert not EXPORTERS["qwen2_moe"].supports(dsmoe, approximation=approximation)  # softmax weights only
    assert EXPORTERS["glm4_moe"].supports(dsmoe, approximation=approximation)


def test_dsmoe_with_every_gate_above_tau_exports_exactly(dsmoe, tokenizer, calib_text, eval_text):
    model = clone(dsmoe)
    for router in (m for m in model.modules() if isinstance(m, ThresholdRouter)):
        router.tau = 0.0  # |A| = n for every token: top-n is the same set, g n / n the same weights
    approximation, parts = approximate(model, tokenizer, calib_text, eval_text, steps=1, seq_len=SEQ_LEN)
    experts = model.get_submodule(next(iter(approximation.routings))).router.num_experts
    assert parts["threshold_routers"]["top_k"] == experts
    assert parts["threshold_routers"]["held_out_agreement"] == 1.0
    export = EXPORTERS["glm4_moe"].build(model, approximation=approximation)
    assert export.model.config.norm_topk_prob is False
    assert _logit_gap(model, export.model) < EXACT_TOLERANCE


def test_tomoe_attention_keeps_its_most_used_dimensions(tomoe, tokenizer, calib_text, eval_text):
    approximation, parts = approximate(tomoe, tokenizer, calib_text, eval_text, steps=1, seq_len=SEQ_LEN)
    attentions = {n: m for n, m in tomoe.named_modules() if isinstance(m, PrunedAttention) and m.router is not None}
    assert set(approximation.attention_dims) == set(attentions)
    for name, dims in approximation.attention_dims.items():
        assert len(dims) == attentions[name].router.top_k and torch.equal(dims, dims.sort().values)
    assert all(0 < layer["held_out_agreement"] <= 1 for layer in parts["attention"]["layers"])
    assert EXPORTERS["qwen2_moe"].supports(tomoe, approximation=approximation)


def test_tomoe_attention_whose_tokens_all_keep_the_same_dimensions_exports_exactly(tomoe, tokenizer, calib_text,
                                                                                   eval_text):
    model = clone(tomoe)
    fixed = {}
    for name, attention in ((n, m) for n, m in model.named_modules() if isinstance(m, PrunedAttention)):
        router = attention.router
        fixed[name] = torch.randperm(attention.head_dim, generator=torch.Generator().manual_seed(0))[:router.top_k]
        with torch.no_grad():  # Proj_D ignores x: every token keeps the same K dimensions
            router.proj_d.weight.zero_()
            router.proj_d.bias.fill_(-1.0).index_fill_(0, fixed[name], 1.0)
    approximation, parts = approximate(model, tokenizer, calib_text, eval_text, steps=1, seq_len=SEQ_LEN)
    assert {n: d.tolist() for n, d in approximation.attention_dims.items()} == \
        {n: sorted(d.tolist()) for n, d in fixed.items()}
    assert parts["attention"]["held_out_agreement"] == 1.0
    export = EXPORTERS["qwen2_moe"].build(model, approximation=approximation)
    assert _logit_gap(model, export.model) < EXACT_TOLERANCE


def test_teal_with_zero_thresholds_exports_the_same_dense_model(teal, tokenizer, calib_text, eval_text):
    model = clone(teal)
    for projection in (m for m in model.modules() if isinstance(m, ThresholdedLinear)):
        projection.threshold.zero_()  # only exact zeros are dropped: they add nothing
    approximation, parts = approximate(model, tokenizer, calib_text, eval_text, steps=1, seq_len=SEQ_LEN)
    assert approximation.drop_thresholds and parts["input_thresholds"]["held_out_agreement"] > 0.99
    export = EXPORTERS["llama"].build(model, approximation=approximation)
    assert not any("threshold" in key for key in export.model.state_dict())
    assert _logit_gap(model, export.model) < EXACT_TOLERANCE


def test_cli_approximate_writes_the_parts_and_the_perplexity_change(teal, tokenizer, tmp_path, capsys):
    native = moeify.save(ConversionResult(teal, tokenizer, {"method": "teal"}), tmp_path / "native")
    assert main(["export", str(native), "--format", "llama", "--out", str(tmp_path / "x")]) == 2
    assert "--approximate exports its closest form" in capsys.readouterr().err
    assert main(["export", str(native), "--format", "llama", "--out", str(tmp_path / "d"), "--approximate"]) == 0
    captured = capsys.readouterr()
    assert "APPROXIMATE" in captured.out and "approximated: input thresholds" in captured.out
    assert "warning: the exported model approximates the converted one" in captured.err
    record = json.loads((tmp_path / "d" / "moeify_export.json").read_text())["approximation"]
    assert "NOT the converted model" in record["note"] and list(record["parts"]) == ["input_thresholds"]
    assert record["ppl_change"] == pytest.approx(record["export_ppl"] - record["source_ppl"])
