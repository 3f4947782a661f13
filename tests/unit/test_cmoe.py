"""CMoE on tiny models of every family: identity with every expert on, partition rules, options."""

import pytest
import torch

from moeify.arch import DecoderAdapter
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import atopk_markers, carve, convert
from moeify.moe.accounting import moe_layers
from moeify.options import OptionError, build_config
from moeify.runtime.moe import MoeMLP
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, tiny_model


def converted(family: str, make_ctx, **options):
    dense = tiny_model(family, **STORIES_VOCAB)
    moe = clone(dense)
    cfg = build_config(CmoeConfig, {"calib_samples": 4, "seq_len": 64, **options})
    details = convert(make_ctx(moe), cfg).details
    return dense, moe, details


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_expert_on_reproduces_dense_logits(family, make_ctx):
    dense, moe, details = converted(family, make_ctx, spec="S1A1E8")
    layers = moe_layers(moe)
    assert len(layers) == DecoderAdapter(moe).num_layers and all(isinstance(m, MoeMLP) for m in layers)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = dense(ids).logits
        sparse = moe(ids).logits
        assert (sparse - reference).abs().max() > 1e-3  # top-1 of 7 routed experts really drops neurons
        for layer in layers:
            layer.router.set_option("top_k", 7)
        torch.testing.assert_close(moe(ids).logits, reference, atol=1e-4, rtol=0)
    assert details["layers"][0]["expert_sizes"] == [11, 11, 11, 11, 11, 11, 11]  # 88 = 8 x 11


def test_partition_covers_every_neuron_with_sizes_differing_by_one():
    g = torch.Generator().manual_seed(0)
    markers = torch.rand(300, 172, generator=g) < 0.1
    for partition in ("balanced_kmeans", "random"):
        cfg = build_config(CmoeConfig, {"spec": "S1A1E8", "partition": partition})
        carving = carve(markers, cfg, torch.Generator().manual_seed(0))
        p = carving.partition
        assert p.covers(172)
        assert p.shared.numel() == 22
        assert sorted(e.numel() for e in p.experts) == [21, 21, 21, 21, 22, 22, 22]
        for rep, expert in zip(carving.representatives, p.experts):
            assert rep in expert
    kmeans = carve(markers, build_config(CmoeConfig, {"spec": "S1A1E8"}), g)
    rates = markers.float().mean(0)
    assert set(kmeans.partition.shared.tolist()) == set(rates.topk(22).indices.tolist())  # Eq. 8


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_carve_finds_planted_experts_on_every_device(device):
    # 14 planted groups of 22 neurons, each firing mostly on its own tokens, and 44 neurons firing on most tokens
    g = torch.Generator().manual_seed(0)
    topic = torch.arange(1400) % 14
    group = torch.arange(44, 352) // 22 - 2
    firing = torch.where(topic[:, None] == group, 0.8, 0.02)
    markers = torch.cat([torch.rand(1400, 44, generator=g) < 0.9, torch.rand(firing.shape, generator=g) < firing], 1)
    carving = carve(markers.to(device), build_config(CmoeConfig, {"spec": "S2A2E16"}), g)
    assert carving.representatives.device.type == "cpu"
    assert torch.equal(carving.partition.shared, torch.arange(44))
    found = sorted(tuple(e.tolist()) for e in carving.partition.experts)
    assert found == [tuple(range(44 + 22 * p, 66 + 22 * p)) for p in range(14)]


def test_atopk_marks_exactly_ka_neurons_per_token():
    dense = tiny_model("llama")
    mlp = DecoderAdapter(dense).mlp(0)
    markers = atopk_markers(mlp, torch.randn(50, 64), ka=10)
    assert markers.shape == (50, 88) and markers.sum(1).tolist() == [10] * 50


@pytest.mark.parametrize("options,message", [
    ({"top_k": "8"}, r"top_k=8 must be <= the routed experts num_experts - num_shared = 7"),
    ({"num_shared": "8"}, r"num_shared=8 must be < num_experts=8"),
    ({"spec": "S1A2"}, r"spec='S1A2' must look like S1A1E8"),
    ({"partition": "kmeans"}, r"partition='kmeans' is not allowed; choose one of: balanced_kmeans, random"),
    ({"ka": "0"}, r"ka=0 is out of range; allowed: \[1, inf\]"),
    ({"topk": "1"}, r"unknown option\(s\) topk .* options: num_experts, num_shared, top_k"),
    ({"lr": "-1"}, r"lr=-1.0 is out of range; allowed: \(0.0, inf\]"),
    ({"num_experts": "two"}, r"num_experts='two' is not a valid int"),
])
def test_bad_options_fail_with_value_and_allowed_range(options, message):
    with pytest.raises(OptionError, match=message):
        build_config(CmoeConfig, options)


def test_model_dependent_limits(make_ctx):
    config = tiny_model("llama").config
    with pytest.raises(OptionError, match=r"num_experts=100 must be <= the MLP width d_h \(88\)"):
        CmoeConfig(num_experts=100).check(config)
    with pytest.raises(OptionError, match=r"seq_len=4096 must be <= the model's context \(128\)"):
        CmoeConfig(seq_len=4096).check(config)


def test_light_finetuning_trains_u_and_moves_bias(make_ctx):
    _, moe, details = converted("llama", make_ctx, spec="S1A2E8", finetune_steps=3, finetune_batch_size=2)
    layers = moe_layers(moe)
    assert details["finetune"]["steps"] == 3
    assert details["finetune"]["u_abs_mean"] > 0  # u was really trainable under LoRA
    assert any(layer.router.bias.abs().sum() > 0 for layer in layers)  # Eq. 33 bias updates ran
    assert not any("lora" in name for name, _ in moe.named_parameters())  # merged into plain weights


def test_router_ranks_experts_by_the_magnitude_of_h_r_unless_asked_for_the_signed_value():
    from moeify.runtime.routers import RepresentativeRouter

    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    routers = {score: RepresentativeRouter(16, 4, 1, "silu", True, False, score=score) for score in ("abs", "signed")}
    routers["signed"].load_state_dict(routers["abs"].state_dict())
    h = routers["abs"].neurons(x)
    assert torch.equal(routers["abs"](x).expert, h.abs().argmax(1).sort().values)  # Eq. 20-26: largest |h_R|
    assert torch.equal(routers["signed"](x).expert, h.argmax(1).sort().values)
    assert not torch.equal(h.abs().argmax(1), h.argmax(1))  # the two readings really differ here
    assert routers["signed"].spec()["score"] == "signed"


def test_analysis_places_the_router_between_the_oracle_and_dropping_everything(make_ctx):
    _, _, details = converted("llama", make_ctx, spec="S1A2E8")
    analysis = details["analysis"]
    assert len(analysis["layers"]) == len(details["layers"])
    for layer in analysis["layers"]:
        assert layer["oracle_search"] == "exact"  # C(7, 2) = 21 subsets
        assert 0 <= layer["oracle"] <= min(layer["router"], layer["router_signed"]) + 1e-6
        assert 0 < layer["static"] < 1
    _, _, details = converted("llama", make_ctx, spec="S1A2E8", analysis=False)
    assert "analysis" not in details


def test_oracle_is_exact_on_few_subsets_and_greedy_beyond():
    import itertools

    from moeify.methods.cmoe import analysis

    outs = torch.randn(40, 6, 8, generator=torch.Generator().manual_seed(1))
    brute = torch.stack([(outs.sum(1) - outs[:, list(s)].sum(1)).pow(2).sum(-1)
                         for s in itertools.combinations(range(6), 2)], 1).min(1).values
    exact, how = analysis._oracle_error(outs, 2)
    assert how == "exact" and torch.allclose(exact, brute, atol=1e-3)
    analysis.EXACT_SUBSETS, saved = 0, analysis.EXACT_SUBSETS
    try:
        greedy, how = analysis._oracle_error(outs, 2)
    finally:
        analysis.EXACT_SUBSETS = saved
    assert how == "greedy" and bool((greedy >= exact - 1e-3).all())


def test_finetune_samples_is_one_pass_over_disjoint_windows(make_ctx):
    _, _, details = converted("llama", make_ctx, spec="S1A2E8", finetune_samples=5, finetune_batch_size=2,
                                finetune_seq_len=32, lora_dropout=0.1)
    assert details["finetune"]["steps"] == 3  # ceil(5 / 2)
    with pytest.raises(OptionError, match="finetune_steps=2 and finetune_samples=5 are alternatives"):
        CmoeConfig(finetune_steps=2, finetune_samples=5)
    with pytest.raises(OptionError, match=r"lora_dropout=1.0 is out of range"):
        CmoeConfig(lora_dropout=1.0)
