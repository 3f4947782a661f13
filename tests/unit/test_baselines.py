"""The two baselines that every comparison table carries: static pruning and the random split."""

import pytest
import torch

from moeify.methods import get_method
from moeify.methods.random_split import RandomSplitConfig
from moeify.methods.static_prune import StaticPruneConfig
from moeify.methods.static_prune.convert import convert
from moeify.moe.accounting import activated_parameters, moe_layers
from moeify.options import OptionError, build_config
from moeify.runtime.attention import PrunedAttention
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_static_prune_keeping_everything_is_the_dense_model(family, make_ctx):
    dense = tiny_model(family, **STORIES_VOCAB)
    ctx = make_ctx(clone(dense))
    convert(ctx, StaticPruneConfig(active_ratio=1.0, calib_samples=4, seq_len=64))
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ctx.model(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)


def test_static_prune_mlp_only_meets_the_requested_ratio_and_computes_narrow(make_ctx):
    """``attention=off`` (the ablation, and the fallback where attention cannot be pruned): MLP channels
    alone meet the budget, so ratios at or below the attention's share are rejected with the range."""
    ctx = make_ctx(tiny_model("llama", **STORIES_VOCAB))
    details = convert(ctx, StaticPruneConfig(active_ratio=0.6, attention="off", calib_samples=4, seq_len=64)).details
    assert not details["attention_pruned"] and details["attention_reason"] == "attention=off"
    assert not any(isinstance(m, PrunedAttention) for m in ctx.model.modules())
    layers = moe_layers(ctx.model)
    assert all(layer.router is None and layer.shared.width == k for layer, k in zip(layers, details["kept_channels"]))
    assert activated_parameters(ctx.model).apr == pytest.approx(0.6, abs=0.005)  # rounding to whole channels
    with pytest.raises(OptionError, match=r"active_ratio=0.3 is out of range .* allowed: \(0.4211, 1.0\]"):
        convert(make_ctx(tiny_model("llama", **STORIES_VOCAB)),
                StaticPruneConfig(active_ratio=0.3, attention="off", calib_samples=4, seq_len=64))


def test_random_split_is_cmoe_with_the_random_partition_fixed():
    assert get_method("random_split").config_cls is RandomSplitConfig
    assert build_config(RandomSplitConfig, {"spec": "S2A2E16"}).partition == "random"
    with pytest.raises(OptionError, match="partition='balanced_kmeans' is not allowed; choose one of: random"):
        build_config(RandomSplitConfig, {"partition": "balanced_kmeans"})
