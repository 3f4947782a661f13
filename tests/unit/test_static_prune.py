"""static_prune with attention head dimensions: the budget is met, importance picks the right dimensions,
unsupported attention falls back to MLP channels and says why, and the result saves and loads."""

import pytest
import torch

import moeify
from moeify.api import ConversionResult
from moeify.arch import DecoderAdapter
from moeify.methods.static_prune import StaticPruneConfig
from moeify.methods.static_prune.convert import convert
from moeify.moe.accounting import activated_parameters, moe_layers
from moeify.moe.attention.importance import HeadDimSquares, qk_pair_importance, vo_dim_importance
from moeify.options import OptionError
from moeify.runtime.attention import PrunedAttention
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model

HD = 16  # tiny models: hidden 64, 4 query heads, 2 key/value heads
IDS = torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(0))


def _prune(make_ctx, model, ratio, **options):
    config = StaticPruneConfig(active_ratio=ratio, calib_samples=4, seq_len=64, **options)
    return convert(make_ctx(model), config).details


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_attention_and_mlp_share_the_kept_ratio(family, ratio, make_ctx):
    model = tiny_model(family, **STORIES_VOCAB)
    details = _prune(make_ctx, model, ratio)
    assert details["attention_pruned"] and details["attention_reason"] is None
    adapter = DecoderAdapter(model)
    pairs, dims = max(1, round(ratio * HD / 2)), max(1, round(ratio * HD))
    for i, layer in enumerate(moe_layers(model)):
        attn = adapter.attention_module(i)
        assert isinstance(attn, PrunedAttention) and len(attn.qk_index) == 2 * pairs and len(attn.vo_index) == dims
        assert layer.router is None and layer.shared.width == details["kept_channels"][i]
    assert details["kept_qk_dims"] == [2 * pairs] * 2 and details["kept_vo_dims"] == [dims] * 2
    assert activated_parameters(model).apr == pytest.approx(ratio, rel=0.01)


def test_unsupported_attention_falls_back_to_mlp_channels_and_says_why(make_ctx):
    model = tiny_model("phi3", **STORIES_VOCAB)
    details = _prune(make_ctx, model, 0.6)
    assert not details["attention_pruned"] and "no separate query, key, value and output" in details["attention_reason"]
    assert not any(isinstance(m, PrunedAttention) for m in model.modules())
    assert activated_parameters(model).apr == pytest.approx(0.6, abs=0.005)  # rounding to whole channels
    with pytest.raises(OptionError, match=r"active_ratio=0.3 is out of range .* allowed: \(0.4211, 1.0\]"):
        _prune(make_ctx, tiny_model("phi3", **STORIES_VOCAB), 0.3)


def test_dimensions_without_signal_are_pruned_first(make_ctx):
    model = tiny_model("llama", **STORIES_VOCAB)
    attn = DecoderAdapter(model).attention_module(0)
    with torch.no_grad():
        attn.q_proj.weight.view(4, HD, -1)[:, [3, 3 + HD // 2]] = 0  # RoPE pair 3 of every query head
        attn.v_proj.weight.view(2, HD, -1)[:, 9] = 0                 # value dimension 9 of every kv head
    _prune(make_ctx, model, 7 / 8)  # keeps 7 of 8 pairs and 14 of 16 value dimensions
    # Untouched, this model would drop pair 2 and value dimensions 5 and 15 in layer 0.
    pruned = DecoderAdapter(model).attention_module(0)
    assert sorted(set(range(HD)) - set(pruned.qk_index.tolist())) == [3, 3 + HD // 2]
    assert 9 not in pruned.vo_index.tolist()


def test_scores_pair_each_query_head_with_its_key_value_head():
    squares = HeadDimSquares(num_heads=4, num_kv_heads=2, head_dim=4)  # query heads 0,1 -> kv 0; 2,3 -> kv 1
    q, k = torch.zeros(1, 4, 4), torch.zeros(1, 2, 4)
    q[0, 2, 0] = k[0, 0, 2] = 1.0        # pair 0 in query head 2 (kv 1) and in kv head 0: never meet
    q[0, 3, 1], k[0, 1, 3] = 2.0, 3.0     # pair 1 (dims 1 and 3) in query head 3 and its kv head 1
    squares.update("q", q.view(1, 16))
    squares.update("k", k.view(1, 8))
    assert qk_pair_importance(squares).tolist() == [0.0, 4.0 * 9.0]
    squares.update("v", torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]))  # kv 0 dim 1, kv 1 dim 2
    o_weight = torch.ones(3, 16)  # every o_proj column has squared norm 3
    assert vo_dim_importance(squares, o_weight).tolist() == [0.0, 2 * 3 * 1.0, 2 * 3 * 4.0, 0.0]


def test_pruned_model_saves_and_loads_identically(make_ctx, tokenizer, tmp_path):
    model = tiny_model("qwen2", **STORIES_VOCAB)
    _prune(make_ctx, model, 0.5)
    out = moeify.save(ConversionResult(model, tokenizer, {"method": "static_prune"}), tmp_path / "out")
    loaded = moeify.load(out)
    assert sum(isinstance(m, PrunedAttention) for m in loaded.modules()) == 2
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    assert activated_parameters(loaded).apr == activated_parameters(model).apr


def test_lora_finetune_gives_the_baseline_the_same_recovery_budget(make_ctx):
    from moeify.methods.static_prune import StaticPruneConfig
    from moeify.methods.static_prune.convert import convert as prune
    from tests.helpers.conversion import clone
    from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model

    model = clone(tiny_model("llama", **STORIES_VOCAB))
    details = prune(make_ctx(model), StaticPruneConfig(active_ratio=0.5, calib_samples=2, seq_len=32,
                                                        finetune_steps=2, finetune_batch_size=2)).details
    assert details["finetune"]["steps"] == 2 and details["finetune"]["trainable_params"] > 0
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged into plain weights


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pruned_head_dims_export_exactly_as_zeros_in_a_dense_llama(family, make_ctx):
    """The default conversion (head dimensions and MLP channels pruned) has an exact standard export:
    zero query/key/value rows and output columns at the pruned dimensions add nothing."""
    from moeify.export.hf_export import EXPORTERS

    model = tiny_model(family, **STORIES_VOCAB)
    _prune(make_ctx, model, 0.5)
    export = EXPORTERS["llama"].build(model)
    assert export.record["exact"] and export.record["max_abs_mlp_diff_float64"] == 0.0
    assert len(export.record["padded_attention_layers"]) == 2
    assert export.record["max_abs_attention_diff_float64"] < 1e-12
    attn = export.model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * HD, 64) and attn.v_proj.weight.shape == (2 * HD, 64)
    with torch.no_grad():
        assert torch.allclose(export.model(IDS).logits, model(IDS).logits, atol=1e-5, rtol=0)
        assert float((attn.q_proj.weight == 0).all(dim=1).float().mean()) == pytest.approx(0.5)  # pruned rows
