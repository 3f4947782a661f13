"""TEAL: thresholds hit the target sparsity on calibration data, activated parameters are the kept
columns, a refit after the weights moved restores the sparsity, and a saved TEAL model reloads
(moeify.load and trust_remote_code) with the same logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import ConversionResult
from moeify.arch import DecoderAdapter
from moeify.methods.teal import TealConfig
from moeify.calibration.data import calibration_batches
from moeify.methods.teal.convert import convert, magnitude_threshold, refit
from moeify.moe.accounting import activated_parameters, tracking_routing
from moeify.options import OptionError
from moeify.runtime.sparse_inputs import ThresholdedLinear
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, tiny_model

IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))


def test_threshold_is_the_magnitude_quantile():
    x = torch.randn(1000, 16, generator=torch.Generator().manual_seed(0))
    t = magnitude_threshold([x[:500], x[500:]], 0.4)
    assert abs(float((x.abs() <= t).float().mean()) - 0.4) < 1e-3


def test_thresholded_linear_zeroes_small_inputs_and_counts_what_it_keeps():
    layer = ThresholdedLinear(4, 3, bias=True, sparsity=0.5, threshold=0.5)
    x = torch.tensor([[0.1, -2.0, 0.4, 1.0]])
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(torch.tensor([[0.0, -2.0, 0.0, 1.0]]),
                                                                    layer.weight, layer.bias))
    layer.track_stats = True
    layer(x)
    assert layer.kept_fraction(measured=True) == 0.5 and layer.kept_fraction(measured=False) == 0.5


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_projection_is_thresholded_and_the_apr_follows_the_sparsity(family, make_ctx):
    model = clone(tiny_model(family, **STORIES_VOCAB))
    details = convert(make_ctx(model), TealConfig(sparsity=0.4, calib_samples=4, seq_len=64)).details
    adapter = DecoderAdapter(model)
    layers = [adapter.layer(i) for i in range(adapter.num_layers)]
    assert not any(type(m) is torch.nn.Linear for layer in layers for m in layer.modules())
    assert len(details["thresholds"]) == model.config.num_hidden_layers
    nominal = activated_parameters(model, measured=False)
    assert nominal.apr == pytest.approx(0.6, abs=0.02)  # biases stay active
    with tracking_routing(model), torch.no_grad():
        model(IDS)
    measured = activated_parameters(model)
    assert measured.measured and 0.3 < measured.apr < 0.9


def test_a_refit_keeps_unmoved_thresholds_and_brings_moved_inputs_back_to_the_sparsity(make_ctx):
    model = clone(tiny_model("llama", **STORIES_VOCAB))
    ctx = make_ctx(model)
    cfg = TealConfig(sparsity=0.5, calib_samples=4, seq_len=64)
    fitted = convert(ctx, cfg).details["thresholds"]
    windows = calibration_batches(ctx.calib, ctx.tokenizer, 4, 64, ctx.seed)

    def apr() -> float:
        with tracking_routing(model), torch.no_grad():
            model(windows)
        return activated_parameters(model).apr

    calibrated = apr()
    assert refit(ctx, cfg)["thresholds"] == fitted  # the same weights: the same cut-offs, bit for bit
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.mul_(3)  # what q/k/v/gate/up read grows threefold
    assert apr() > calibrated + 0.1  # the old cut-offs now keep far more inputs
    moved = refit(ctx, cfg)["thresholds"]
    assert moved[0]["self_attn.q_proj"] == pytest.approx(3 * fitted[0]["self_attn.q_proj"], rel=1e-3)
    assert apr() == pytest.approx(calibrated, abs=0.005)


def test_a_saved_teal_model_reloads_with_the_same_logits(make_ctx, tokenizer, tmp_path):
    model = clone(tiny_model("llama", **STORIES_VOCAB))
    ctx = make_ctx(model)
    convert(ctx, TealConfig(sparsity=0.5, calib_samples=4, seq_len=64))
    with torch.no_grad():
        expected = ctx.model(IDS).logits
        dense = tiny_model("llama", **STORIES_VOCAB)(IDS).logits
    assert (expected - dense).abs().max() > 1e-3  # the thresholds really drop inputs
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "teal"}), tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(moeify.load(out)(IDS).logits, expected)
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        assert torch.equal(remote(IDS).logits, expected)


def test_sparsity_range_is_checked():
    with pytest.raises(OptionError, match=r"sparsity=1.0 is out of range; allowed: \[0.0, 0.99\]"):
        TealConfig(sparsity=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0.1234567, 0.30078125, 0.0])  # not a bfloat16 value, one, and no threshold
def test_the_one_pass_cpu_path_zeroes_exactly_what_the_float32_comparison_does(dtype, t):
    layer = ThresholdedLinear(64, 8, bias=True, sparsity=0.5, threshold=t).to(dtype)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, :4] = torch.tensor([t, -t, t * 1.001, -t * 0.999]).to(dtype)  # on and around the cut-off
    expected = torch.nn.functional.linear(x * (x.abs().float() > t), layer.weight, layer.bias)
    assert torch.equal(layer(x), expected)


def test_threshold_stays_float32_in_a_bfloat16_model():
    t = 0.1234567  # not a bfloat16 value: rounding it would move the kept share
    layer = ThresholdedLinear(4, 3, bias=False, sparsity=0.5, threshold=t).to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and layer.threshold.dtype == torch.float32
    assert float(layer.threshold) == pytest.approx(t, rel=1e-7)
    x = torch.tensor([[t * 1.001, 0.0, 0.0, 0.0]]).to(torch.bfloat16)
    assert float(x[0, 0]) > t and x[0, 0] == torch.tensor(t).to(torch.bfloat16)  # above t, equal to t in bf16
    layer.track_stats = True
    layer(x)
    assert layer.stats_kept == 1
