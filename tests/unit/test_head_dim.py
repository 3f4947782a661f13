"""Attention with a pruned head dimension: exact against masked dense attention, cached, saved, counted."""

import pytest
import torch

import moeify
from moeify.api import ConversionResult
from moeify.arch import DecoderAdapter
from moeify.moe.accounting import activated_parameters
from moeify.moe.attention.head_dim import head_dim_support, pruned_attention, rope_pairs
from moeify.runtime.attention import HeadDimRouter
from tests.helpers.conversion import assert_cached_generation_equals_uncached, clone
from tests.helpers.remote import logits_without_moeify
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model
from tests.unit.test_moe_layer import CountedOperations

IDS = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
HD = 16  # tiny models: hidden 64, 4 heads


def _masking_hooks(model, qk_mask, vo_masks):
    """Hooks that zero the pruned dimensions of the dense model's q/k (static) and v / o inputs (per token)."""
    handles = []
    for i, layer in enumerate(DecoderAdapter(model).layers):
        attn = layer.self_attn
        tile = lambda out, m: (out.view(*out.shape[:-1], -1, HD) * m).view(out.shape)  # noqa: E731
        handles.append(attn.q_proj.register_forward_hook(lambda _m, _i, out: tile(out, qk_mask)))
        handles.append(attn.k_proj.register_forward_hook(lambda _m, _i, out: tile(out, qk_mask)))
        m = vo_masks[i]
        handles.append(attn.v_proj.register_forward_hook(lambda _m, inp, out, m=m: tile(out, m(inp[0])[..., None, :])))
        handles.append(attn.o_proj.register_forward_pre_hook(
            lambda _m, inp, m=m, a=attn: (tile(inp[0], m(a._last_x)[..., None, :]),)))
        handles.append(attn.register_forward_pre_hook(
            lambda mod, args, kwargs: setattr(mod, "_last_x", kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True))
    return handles


def _masked_dense_logits(dense, qk_mask, vo_masks):
    """The dense model's logits with the pruned dimensions zeroed by ``_masking_hooks`` (removed after)."""
    handles = _masking_hooks(dense, qk_mask, vo_masks)
    with torch.no_grad():
        logits = dense(IDS).logits
    for h in handles:
        h.remove()
    return logits


def _prune(model, qk_half, routers=None, vo=None):
    adapter = DecoderAdapter(model)
    for i in range(adapter.num_layers):
        router = None if routers is None else routers[i]
        adapter.replace_attention_(i, pruned_attention(adapter, i, rope_pairs(qk_half, HD), vo, router))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_keeping_every_dimension_is_the_dense_attention(family):
    dense = tiny_model(family)
    model = clone(dense)
    _prune(model, torch.arange(HD // 2), vo=torch.arange(HD))
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, dense(IDS).logits, atol=1e-5, rtol=0)
    assert activated_parameters(model).apr == pytest.approx(1.0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_and_routed_pruning_equal_masked_dense_attention(family):
    dense = tiny_model(family)
    torch.manual_seed(0)
    routers = [HeadDimRouter(64, HD, embed_dim=8, top_k=5) for _ in range(2)]
    qk_half = torch.tensor([0, 3, 4, 6])
    qk_mask = torch.zeros(HD).index_fill(0, rope_pairs(qk_half, HD), 1.0)

    def routed(router):
        return lambda x: torch.zeros(*x.shape[:-1], HD).scatter(-1, router(x), 1.0)

    expected = _masked_dense_logits(dense, qk_mask, [routed(r) for r in routers])
    model = clone(dense)
    _prune(model, qk_half, routers=routers)
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(expected, tiny_model(family)(IDS).logits, atol=1e-3)  # pruning did something


def test_queries_keys_and_values_of_two_widths_run_the_fused_attention_kernel():
    """Values (3 dimensions) narrower than queries/keys (8), and routed values (16) wider: both run SDPA's fused
    kernel (the widths padded to one), not its unfused math, and give the masked dense attention's logits."""
    dense = tiny_model("llama", **STORIES_VOCAB)
    qk_half, vo = torch.tensor([0, 3, 4, 6]), torch.tensor([2, 5, 9])
    qk_mask = torch.zeros(HD).index_fill(0, rope_pairs(qk_half, HD), 1.0)
    vo_mask = torch.zeros(HD).index_fill(0, vo, 1.0)
    expected = _masked_dense_logits(dense, qk_mask, [lambda x: vo_mask.expand(*x.shape[:-1], HD)] * 2)
    narrow = clone(dense)
    _prune(narrow, qk_half, vo=vo)
    for model in (narrow, routed_model()):
        counted = CountedOperations()
        with torch.no_grad(), counted:
            model(IDS)
        assert counted.operations["_scaled_dot_product_flash_attention_for_cpu"] == 2
        assert "_safe_softmax" not in counted.operations  # the unfused math path's softmax
    assert torch.allclose(narrow(IDS).logits, expected, atol=1e-5, rtol=0)


def routed_model():
    """A tiny LLaMA keeping Q/K RoPE pairs 1, 2 and 5 of every head and routing V/O to 4 of 16 dimensions."""
    model = tiny_model("llama", **STORIES_VOCAB)
    torch.manual_seed(1)
    _prune(model, torch.tensor([1, 2, 5]), routers=[HeadDimRouter(64, HD, embed_dim=8, top_k=4) for _ in range(2)])
    return model


def test_cached_generation_save_load_and_counting(tokenizer, tmp_path):
    total = activated_parameters(tiny_model("llama", **STORIES_VOCAB)).total_params
    model = routed_model()
    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    assert_cached_generation_equals_uncached(model, ids, 6)
    # By hand, per layer: q 4 heads x 6 dims x 64 + k 2 x 6 x 64; v 2 x 4 x 64 and o 4 x 4 x 64 per token.
    attn = 4 * 6 * 64 + 2 * 6 * 64 + 2 * 4 * 64 + 4 * 4 * 64
    mlp = 3 * 64 * 88
    counted = activated_parameters(model)
    assert counted.total_params == total and counted.active_params == 2 * (attn + mlp)
    assert counted.router_params == 2 * (64 * 8 + 8 + 2 * 8 + 8 * HD + HD)
    out = moeify.save(ConversionResult(model, tokenizer, {"method": "test"}), tmp_path / "out")
    loaded = moeify.load(out)
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(loaded(ids).logits, expected)


@pytest.mark.slow  # a fresh Python process loads transformers (~3 s)
def test_saved_folder_computes_without_moeify(tokenizer, tmp_path):
    model = routed_model()
    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    out = moeify.save(ConversionResult(model, tokenizer, {"method": "test"}), tmp_path / "out")
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.allclose(logits_without_moeify(out, ids, tmp_path), expected, atol=1e-5, rtol=0)  # moeify_attention.py


def test_unsupported_attention_is_explained():
    assert head_dim_support(DecoderAdapter(tiny_model("llama")), 0) is None
    assert "normalises query/key heads" in head_dim_support(DecoderAdapter(tiny_model("qwen3")), 0)
    assert "separate" in head_dim_support(DecoderAdapter(tiny_model("phi3")), 0)
    with pytest.raises(ValueError, match="cannot prune the head dimension"):
        pruned_attention(DecoderAdapter(tiny_model("gpt_neox")), 0, torch.arange(4), torch.arange(8))
