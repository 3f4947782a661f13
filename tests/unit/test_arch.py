"""The architecture layer against the real transformers modules of every supported family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, BertConfig, GPT2Config

from moeify.arch import (
    FAMILIES,
    DecoderAdapter,
    FamilySpec,
    MlpWeights,
    NotDenseMlpError,
    UnsupportedFamilyError,
    family_for,
)
from tests.helpers.tiny_models import FAMILY_NAMES, HIDDEN, INTERMEDIATE, LAYERS, tiny_config, tiny_model

# Every family as built, plus LLaMA with MLP biases so a gated MLP with gate/up/down biases is covered.
CASES = [pytest.param(f, {}, id=f) for f in FAMILY_NAMES] + [
    pytest.param("llama", {"mlp_bias": True, "attention_bias": True}, id="llama-biases")
]
GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "olmo2", "granite", "phi3"}
TOL = 1e-5


class WeightsMlp(nn.Module):
    """A stand-in MLP computing ``MlpWeights.forward``: same function as the dense MLP, different module."""

    def __init__(self, weights: MlpWeights) -> None:
        super().__init__()
        self.weights = weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights.forward(x)


class ZeroMlp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def _x(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(3, 5, HIDDEN, generator=g)


def _ids(seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, 9), generator=g)


def test_family_names_cover_families() -> None:
    assert set(FAMILY_NAMES) == {fam.name for fam in FAMILIES}
    assert len({mt for fam in FAMILIES for mt in fam.model_types}) == sum(len(f.model_types) for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_for_and_layout(family: str) -> None:
    model = tiny_model(family)
    adapter = DecoderAdapter(model)
    assert family_for(model.config).name == family
    assert adapter.family.name == family
    assert adapter.num_layers == LAYERS == len(adapter.layers)
    assert adapter.layers_path == ("gpt_neox.layers" if family == "gpt_neox" else "model.layers")
    assert model.get_submodule(adapter.layers_path) is adapter.layers
    for i in range(adapter.num_layers):
        assert adapter.layer(i) is adapter.layers[i]
        assert adapter.mlp_path(i) == f"{adapter.layers_path}.{i}.mlp"
        assert model.get_submodule(adapter.mlp_path(i)) is adapter.mlp_module(i)
        # The norm named as feeding the MLP exists in the layer (OLMo-2, post-norm: the MLP reads h itself).
        if adapter.family.mlp_norm_attr is not None:
            assert isinstance(getattr(adapter.layer(i), adapter.family.mlp_norm_attr), nn.Module)
    with pytest.raises(IndexError):
        adapter.layer(LAYERS)
    assert adapter.uses_parallel_residual() == (family in {"gpt_neox", "phi"})


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_base_model_without_lm_head(family: str) -> None:
    model = tiny_model(family)
    base = DecoderAdapter(model.base_model)
    assert base.layers_path == "layers"
    assert base.layers is DecoderAdapter(model).layers


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_mlp_weights_reproduce_module(family: str, overrides: dict) -> None:
    model = tiny_model(family, **overrides)
    adapter = DecoderAdapter(model)
    x = _x()
    for i in range(adapter.num_layers):
        w = adapter.mlp(i)
        assert w.gated == (family in GATED)
        assert (w.hidden_size, w.intermediate_size) == (HIDDEN, INTERMEDIATE)
        assert w.act == getattr(model.config, adapter.family.act_config_key)
        with torch.no_grad():
            expected = adapter.mlp_module(i)(x)
            got = w.forward(x)
        assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_mlp_biases_are_exposed(family: str, overrides: dict) -> None:
    w = DecoderAdapter(tiny_model(family, **overrides)).mlp(0)
    has_bias = family in {"gpt_neox", "phi"} or overrides.get("mlp_bias", False)
    assert (w.up_bias is not None) == has_bias
    assert (w.down_bias is not None) == has_bias
    assert (w.gate_bias is not None) == (has_bias and w.gated)
    if has_bias:
        assert w.down_bias.abs().sum() > 0 and w.up_bias.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_mlp_weights_are_views_of_parameters(family: str) -> None:
    adapter = DecoderAdapter(tiny_model(family))
    w = adapter.mlp(0)
    down = adapter.mlp_module(0).get_submodule(adapter.family.down_proj).weight
    assert w.down.data_ptr() == down.data_ptr()
    assert not w.down.requires_grad and not w.up.requires_grad


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_neuron_partition_sums_to_dense(family: str, overrides: dict) -> None:
    adapter = DecoderAdapter(tiny_model(family, **overrides))
    x = _x()
    g = torch.Generator().manual_seed(3)
    for i in range(adapter.num_layers):
        w = adapter.mlp(i)
        perm = torch.randperm(w.intermediate_size, generator=g)
        cuts = sorted(torch.randperm(w.intermediate_size - 1, generator=g)[:4].add(1).tolist())
        parts = torch.tensor_split(perm, cuts)
        assert sum(len(p) for p in parts) == w.intermediate_size
        total = sum(w.select(p).forward(x) for p in parts)
        if w.down_bias is not None:
            total = total + w.down_bias
        assert (total - w.forward(x)).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_replace_mlp_changes_model_output(family: str) -> None:
    model = tiny_model(family)
    adapter = DecoderAdapter(model)
    ids = _ids()
    with torch.no_grad():
        dense_logits = model(ids).logits
        dense_params = [adapter.dense_mlp_params(i) for i in range(adapter.num_layers)]

        # Same function through MlpWeights (cloned, so it does not depend on the removed module).
        for i in range(adapter.num_layers):
            w = adapter.mlp(i)
            tensors = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "act"}
            clone = dataclasses.replace(w, **{k: t.clone() for k, t in tensors.items() if t is not None})
            replacement = WeightsMlp(clone)
            adapter.replace_mlp_(i, replacement)
            assert adapter.mlp_module(i) is replacement
            assert model.get_submodule(adapter.mlp_path(i)) is replacement
            assert not adapter.is_dense_mlp(i)
        torch.testing.assert_close(model(ids).logits, dense_logits, rtol=0, atol=TOL)

        with pytest.raises(NotDenseMlpError, match="already replaced"):
            adapter.mlp(0)
        with pytest.raises(NotDenseMlpError):
            adapter.dense_mlp_params(0)

        adapter.replace_mlp_(0, ZeroMlp())
        assert (model(ids).logits - dense_logits).abs().max().item() > 1e-3

    expected = 3 * HIDDEN * INTERMEDIATE if family in GATED else 2 * HIDDEN * INTERMEDIATE + INTERMEDIATE + HIDDEN
    assert dense_params == [expected] * LAYERS


def test_replace_mlp_rejects_non_module() -> None:
    adapter = DecoderAdapter(tiny_model("llama"))
    with pytest.raises(TypeError):
        adapter.replace_mlp_(0, lambda x: x)  # type: ignore[arg-type]


def test_swapped_activation_is_detected() -> None:
    adapter = DecoderAdapter(tiny_model("llama"))
    adapter.mlp_module(1).act_fn = nn.ReLU()
    adapter.mlp(0)
    with pytest.raises(ValueError, match="ACT2FN"):
        adapter.mlp(1)


def _attn_hand_count(family: str) -> int:
    c = tiny_config(family)
    d, heads = c.hidden_size, c.num_attention_heads
    hd = d // heads
    kv = getattr(c, "num_key_value_heads", heads)
    q, k, v, o = d * heads * hd, d * kv * hd, d * kv * hd, heads * hd * d
    if family == "llama":  # four projections, GQA k/v, no biases
        return q + k + v + o
    if family == "qwen2":  # biases on q/k/v only
        return q + k + v + o + heads * hd + 2 * kv * hd
    if family == "phi":  # biases on all four, o is called dense
        return q + k + v + o + heads * hd + 2 * kv * hd + d
    if family == "gpt_neox":  # fused qkv (3d) and dense, both with bias, no GQA
        return d * 3 * d + 3 * d + d * d + d
    raise AssertionError(family)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi", "gpt_neox"])
def test_attention_params_hand_count(family: str) -> None:
    adapter = DecoderAdapter(tiny_model(family))
    for i in range(adapter.num_layers):
        assert adapter.attention_params(i) == _attn_hand_count(family)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_attention_projections_roles(family: str) -> None:
    adapter = DecoderAdapter(tiny_model(family))
    projs = adapter.attention_projections(0)
    fused = family in {"phi3", "gpt_neox"}
    assert set(projs) == ({"qkv", "o"} if fused else {"q", "k", "v", "o"})
    assert all(isinstance(p, nn.Linear) for p in projs.values())
    assert projs["o"].out_features == HIDDEN
    # Every projection is a submodule of the attention module, and counted once.
    attn_params = {id(p) for p in adapter.attention_module(0).parameters()}
    assert all(id(p) in attn_params for proj in projs.values() for p in proj.parameters())


def test_unsupported_model_lists_supported_types() -> None:
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedFamilyError) as info:
        DecoderAdapter(model)
    message = str(info.value)
    assert "'gpt2'" in message
    for fam in FAMILIES:
        for model_type in fam.model_types:
            assert model_type in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedFamilyError, match="bert"):
        family_for(BertConfig())


def test_family_spec_is_frozen_and_validated() -> None:
    spec = FAMILIES[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    hash(spec)
    with pytest.raises(ValueError, match="needs gate_proj"):
        dataclasses.replace(spec, gate_proj=None)
    with pytest.raises(ValueError, match="attention roles"):
        dataclasses.replace(spec, attn_projections=(("q", "q_proj"), ("o", "o_proj")))
    with pytest.raises(ValueError, match="has no gate_up_proj"):
        FamilySpec(
            name="bad",
            model_types=("bad",),
            layers_path="model.layers",
            mlp_attr="mlp",
            attn_attr="self_attn",
            mlp_norm_attr="post_attention_layernorm",
            mlp_kind="plain",
            up_proj="fc1",
            down_proj="fc2",
            gate_up_proj="gate_up",
        )
