"""Every registered method on a tiny model of every registered family: it converts, a method whose MoE
layers partition the MLP reproduces it with every expert on, generation with a KV cache equals generation
without, and save -> load gives the same logits. Methods and families come from the registries, so a new
one is tested here without touching this file (families need a tiny config in ``tests/helpers``)."""

from __future__ import annotations

import pytest
import torch

import moeify
from moeify.api import ConversionResult
from moeify.arch import FAMILIES, DecoderAdapter
from moeify.methods import METHODS, Conversion, Method
from moeify.moe.accounting import moe_layers
from moeify.options import build_config
from tests.helpers.conversion import FAST, assert_cached_generation_equals_uncached, clone, conversion_context
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, VARIANT_NAMES, tiny_model

IDS = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(11))
# Untrained, so that "every expert on" can be compared with the dense MLP (DSMoE: steps=0 is the dense model
# split into experts).
UNTRAINED = {"dsmoe": {"steps": 0}}
# In the tiny models attention is up to 59 % of the parameters: where it cannot be pruned (fused qkv),
# static pruning of the MLP alone cannot reach its default APR 0.5.
REACHABLE = {"static_prune": {"active_ratio": 0.8}}


def test_every_registered_family_has_a_tiny_model():
    assert {f.name for f in FAMILIES} == set(FAMILY_NAMES)


def converted(method: Method, family: str, tokenizer, calib_text, options: dict):
    dense = tiny_model(family, **STORIES_VOCAB)
    model = clone(dense)
    config = build_config(method.config_cls, {**FAST.get(method.name, {}), **options})
    method.check(config, model.config)
    torch.manual_seed(0)
    conversion = method.run(conversion_context(model, tokenizer, calib_text), config)
    # the contract: the model converted in place comes back with the method's details and files
    assert isinstance(conversion, Conversion) and conversion.model is model
    assert isinstance(conversion.details, dict) and all(isinstance(v, bytes) for v in conversion.artifacts.values())
    return dense, model.eval()


@pytest.mark.parametrize("family", FAMILY_NAMES + VARIANT_NAMES)
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_method_on_family(method, family, tokenizer, calib_text, tmp_path):
    dense, model = converted(method, family, tokenizer, calib_text, REACHABLE.get(method.name, {}))
    assert_cached_generation_equals_uncached(model, IDS[:1, :6], 8)
    with torch.no_grad():
        logits = model(IDS).logits
        folder = moeify.save(ConversionResult(model, tokenizer, {"method": method.name}), tmp_path / "m")
        torch.testing.assert_close(moeify.load(folder)(IDS).logits, logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILY_NAMES + VARIANT_NAMES)
@pytest.mark.parametrize("method", [m for m in METHODS if m.partitions_mlp], ids=lambda m: m.name)
def test_every_expert_on_reproduces_the_dense_mlp(method, family, tokenizer, calib_text):
    dense, model = converted(method, family, tokenizer, calib_text, UNTRAINED.get(method.name, {}))
    layers = moe_layers(model)
    assert layers, f"{method.name} made no MoE layer"
    source, target = DecoderAdapter(dense), DecoderAdapter(model)
    x = torch.randn(3, 7, dense.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in range(target.num_layers):
            layer = target.mlp_module(i)
            if layer in layers:
                torch.testing.assert_close(layer.forward_all_experts(x), source.mlp_module(i)(x), atol=1e-5, rtol=1e-5)
