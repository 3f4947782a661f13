"""TEAL's thresholds on the attention of an MoE conversion (``attention_sparsity``): what is thresholded, what
it frees of the budget, how ``compare`` gives it to the MLP, the refit after a recovery, and what is refused."""

import json

import pytest
import torch

import moeify
from moeify.api import recover_run
from moeify.api.compare import _runs
from moeify.arch import DecoderAdapter
from moeify.methods import method_configs
from moeify.methods.teal.config import AttentionSparsityOptions
from moeify.moe.accounting import attention_share
from moeify.options import OptionError
from moeify.runtime.sparse_inputs import ThresholdedLinear
from tests.helpers.conversion import FAST

IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
TEAL_WINDOWS = {"calib_samples": 4, "seq_len": 64}  # for the refit of TEAL's own model, as small as the test's


def thresholded(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, ThresholdedLinear)}


@pytest.mark.parametrize("method", ["cmoe", "more", "dense2moe"])
def test_the_attention_alone_is_thresholded_and_frees_its_share_of_the_budget(method, tmp_path):
    whole = moeify.convert(None, method, FAST[method], measure_speed=False)
    result = moeify.convert(None, method, {**FAST[method], "attention_sparsity": 0.5}, measure_speed=False)
    adapter = DecoderAdapter(result.model)
    projections = {f"{adapter.layers_path}.{i}.{adapter.family.attn_attr}.{attr}"
                   for i in range(adapter.num_layers) for _, attr in adapter.family.attn_projections}
    assert set(thresholded(result.model)) == projections  # the MLPs, experts and routers untouched
    assert all(m.sparsity == 0.5 and float(m.threshold) > 0 for m in thresholded(result.model).values())
    record = result.record
    assert record["config"]["attention_sparsity"] == 0.5 and "attention_s" in record["timings"]
    assert len(record["details"]["attention_sparsity"]["thresholds"]) == adapter.num_layers
    # the APR counts the kept inputs' columns: about half of the attention's share is freed
    freed = whole.record["active"]["apr"] - record["active"]["apr"]
    assert freed == pytest.approx(0.5 * attention_share(DecoderAdapter(moeify.load_model(None)[0])), rel=0.25)
    saved = moeify.save(result, tmp_path / method)
    with torch.no_grad():
        torch.testing.assert_close(moeify.load(saved)(IDS).logits, result.model(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize(("method", "options", "message"), [
    ("teal", {}, "teal prunes or thresholds the attention itself"),
    ("tomoe", {}, r"tomoe prunes .* \(attention=off keeps it whole\)"),
    ("static_prune", {"attention": "on"}, "static_prune prunes"),
])
def test_a_method_that_prunes_or_thresholds_the_attention_is_refused(method, options, message):
    with pytest.raises(OptionError, match=message):
        method_configs(method, {**options, "attention_sparsity": "0.5"})
    *_, attention = method_configs("tomoe", {"attention": "off", "attention_sparsity": "0.5"})
    assert attention.attention_sparsity == 0.5


def test_out_of_range_and_layer_by_layer_are_refused(capsys, tmp_path):
    with pytest.raises(OptionError, match=r"attention_sparsity=1.0 is out of range; allowed: \[0.0, 0.99\]"):
        method_configs("cmoe", {"attention_sparsity": "1.0"})
    with pytest.raises(OptionError, match="cannot run layer by layer"):
        moeify.convert(None, "cmoe", {"attention_sparsity": 0.5}, layer_by_layer=True)


def test_compare_gives_the_mlp_what_the_thresholds_free():
    model, _ = moeify.load_model(None)
    adapter = DecoderAdapter(model)
    share = attention_share(adapter)
    options = {"cmoe": {"attention_sparsity": "0.5"}}
    (_, _, plain, _), = _runs(["cmoe"], 0.5, adapter, None, {})
    (_, _, attempts, how), = _runs(["cmoe"], 0.5, adapter, None, options)
    own = AttentionSparsityOptions(attention_sparsity=0.5).apr_for_method(0.5, share)
    assert own == pytest.approx(0.5 + 0.5 * share) and f"APR {own:.3f} with the attention whole" in how
    assert attempts != plain  # a wider MLP share


@pytest.mark.slow
def test_a_recovery_calibrates_the_attention_thresholds_again_in_convert_and_in_recover(tmp_path):
    recovery = {"recover_tokens": 512, "recover_seq_len": 64, "recover_lr": 3e-3}
    result = moeify.convert(None, "cmoe", {**FAST["cmoe"], "attention_sparsity": 0.5, **recovery},
                            measure_speed=False)
    record = result.record
    fitted = record["details"]["attention_sparsity"]["thresholds"]
    refitted = record["recovery"]["refit"]["attention_sparsity"]["thresholds"]
    assert list(map(set, refitted)) == list(map(set, fitted)) and refitted != fitted  # the same projections
    assert record["active"]["apr"] == pytest.approx(record["pre_recovery"]["active"]["apr"], abs=0.03)
    again = recover_run(moeify.save(result, tmp_path / "cmoe"), recovery, measure_speed=False).record
    assert again["recovery"]["refit"]["attention_sparsity"]["thresholds"] != refitted


def test_the_plan_counts_the_thresholds_calibration_where_it_holds_more_than_the_methods():
    from moeify.memory_plan import plan

    plain, thresholded = (plan("llama-2-7b", "cmoe", {"calib_samples": "1", "seq_len": "64", **options})
                          for options in ({}, {"attention_sparsity": "0.5"}))
    # TEAL's eight 2048-token windows over the method's one of 64: more hidden states and statistics
    assert sum(thresholded.phases["convert"].values()) > sum(plain.phases["convert"].values())


def test_a_resumed_compare_keeps_a_run_only_with_the_thresholds_asked_now(tmp_path):
    from moeify.api.compare import _kept_options

    (tmp_path / "record.json").write_text(json.dumps({"config": {"spec": "S2A2E8", "attention_sparsity": 0.5}}))
    attempts = [{"spec": "S2A2E8"}]
    assert _kept_options("cmoe", attempts, {"attention_sparsity": "0.5"}, {}, tmp_path) == \
        {"spec": "S2A2E8", "attention_sparsity": "0.5"}
    assert _kept_options("cmoe", attempts, {}, {}, tmp_path) is None  # asked without: converted again
    (tmp_path / "record.json").write_text(json.dumps({"config": {"spec": "S2A2E8"}}))  # an earlier record
    assert _kept_options("cmoe", attempts, {}, {}, tmp_path) == {"spec": "S2A2E8"}
