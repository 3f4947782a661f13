"""The activated ratio as each paper counts it, recorded beside MoRE's APR."""

import pytest

from moeify.methods import METHODS
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.methods.more import MoreConfig
from moeify.methods.more.convert import convert as convert_more
from moeify.moe.accounting import PAPER_RATIOS, activated_parameters, moe_layers, paper_ratio
from moeify.options import build_config
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model


def test_each_definition_counts_what_its_paper_counts(make_ctx):
    model = clone(tiny_model("llama", **STORIES_VOCAB))
    convert(make_ctx(model), build_config(CmoeConfig, {"spec": "S1A1E8", "calib_samples": 2, "seq_len": 32}))
    active = activated_parameters(model, measured=False)
    assert paper_ratio(model, active, "ffn")["value"] == active.mlp_ratio == pytest.approx(0.25, abs=0.01)
    assert paper_ratio(model, active, "apr")["value"] == active.apr
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    other = embeddings.numel() + (0 if head is embeddings else head.numel()) + norms  # a tied head counts once
    whole = paper_ratio(model, active, "model")
    assert whole["value"] == pytest.approx((active.active_params + other) / (active.total_params + other))
    assert active.apr < whole["value"] < 1 and "embeddings" in whole["definition"]
    with pytest.raises(ValueError, match="paper ratio 'flops' is unknown"):
        paper_ratio(model, active, "flops")


def test_every_method_names_a_known_definition():
    assert {m.name: m.paper_ratio for m in METHODS if m.paper_ratio != "apr"} == {
        "cmoe": "ffn", "random_split": "ffn", "more": "uniform", "dsmoe": "model", "dense2moe": "model"}
    assert all(m.paper_ratio in PAPER_RATIOS for m in METHODS)


def test_uniform_routing_ignores_the_routing_seen_on_data(make_ctx):
    """MoRE's Eq. 16 counts the experts as chosen equally often: routing every token to the smallest petal
    lowers the measured APR but not the uniform ratio, which is MoRE's own pruning rate's complement."""
    model = clone(tiny_model("llama", **STORIES_VOCAB))
    details = convert_more(make_ctx(model), build_config(MoreConfig, {"calib_samples": 8, "seq_len": 64})).details
    for layer in moe_layers(model):
        layer.stats_tokens = 10
        layer.stats_expert_tokens.zero_()
        layer.stats_expert_tokens[layer.expert_widths.index(min(layer.expert_widths))] = 10
    measured = activated_parameters(model, measured=True)
    uniform = paper_ratio(model, measured, "uniform")
    assert uniform["value"] == pytest.approx(1 - details["pruning_rate_uniform"])
    assert measured.apr < uniform["value"] - 1e-3 and uniform["label"] == "attention + MLP, uniform routing"
