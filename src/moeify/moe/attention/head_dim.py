"""Build ``PrunedAttention`` from a decoder layer's dense attention: shared by ToMoE and the static-prune
baseline. The projections come by role (q, k, v, o) from ``DecoderAdapter.attention_projections``.

Head-dimension pruning needs LLaMA-style attention: separate q/k/v/o projections and a rotary embedding
over the whole head, with no norm on the query/key heads (a Qwen3-style q_norm normalises over the
full head, so a pruned head would change the norm). ``head_dim_support`` says which modules qualify and
why not otherwise; LLaMA, Mistral and Qwen2 do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moeify.arch import DecoderAdapter
from moeify.runtime.attention import PrunedAttention, pruned_projection_params

_ROLES = ("q", "k", "v", "o")


def head_dim_support(adapter: DecoderAdapter, i: int) -> str | None:
    """None when layer ``i``'s attention can have its head dimension pruned, else the reason it cannot."""
    attn = adapter.attention_module(i)
    if sorted(adapter.attention_projections(i)) != sorted(_ROLES):
        return f"{type(attn).__name__} has no separate query, key, value and output projections"
    if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
        return f"{type(attn).__name__} normalises query/key heads over the full head dimension"
    if getattr(attn.config, "attn_logit_softcapping", None):
        return f"{type(attn).__name__} soft-caps its attention scores"
    if abs(getattr(attn, "scaling", attn.head_dim ** -0.5) - attn.head_dim ** -0.5) > 1e-9:
        return f"{type(attn).__name__} scales its scores by {attn.scaling:g}, not 1/sqrt(head_dim)"
    rope = getattr(attn.config, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", getattr(attn.config, "partial_rotary_factor", 1.0))) != 1.0:
        return f"{type(attn).__name__} rotates only part of each head (partial_rotary_factor != 1)"
    return None


def rope_pairs(first_half: Tensor, head_dim: int) -> Tensor:
    """ToMoE Appendix A.2: s_0' = [s_0[:hd/2], s_0[:hd/2]], as indices: every kept i < hd/2 with i + hd/2."""
    first_half = first_half.sort().values
    return torch.cat([first_half, first_half + head_dim // 2])


def _geometry(projections: dict[str, nn.Linear], head_dim: int) -> tuple[int, int, int]:
    """(d, query heads, key/value heads)."""
    return (projections["q"].in_features, projections["q"].out_features // head_dim,
            projections["k"].out_features // head_dim)


def attention_geometry(adapter: DecoderAdapter, i: int) -> tuple[int, int, int]:
    """(d, query heads, key/value heads) of layer ``i``'s attention."""
    return _geometry(adapter.attention_projections(i), adapter.attention_module(i).head_dim)


def head_dim_costs(adapter: DecoderAdapter, i: int) -> tuple[int, int, int]:
    """Projection parameters of layer ``i``'s LLaMA-style attention per kept query/key dimension (q and k
    rows of every head), per kept value/output dimension (v rows, o columns) and independent of the head
    dimension (the output projection's bias): what a head-dimension budget (ToMoE's R_P) counts."""
    p = adapter.attention_projections(i)
    d, heads, kv_heads = _geometry(p, adapter.attention_module(i).head_dim)
    qk = d * (heads + kv_heads) + (heads + kv_heads if p["q"].bias is not None else 0)
    vo = d * (heads + kv_heads) + (kv_heads if p["v"].bias is not None else 0)
    return qk, vo, d if p["o"].bias is not None else 0


def head_group_costs(adapter: DecoderAdapter, i: int) -> tuple[int, int]:
    """Projection parameters of layer ``i``'s LLaMA-style attention per key/value head kept whole with its
    query heads (q, k, v rows and o columns of the group), and independent of the heads (the output
    projection's bias): what a head-pruning budget (ToMoE's R_P with ``attention=heads``) counts."""
    p, hd = adapter.attention_projections(i), adapter.attention_module(i).head_dim
    d, heads, kv_heads = _geometry(p, hd)
    return (pruned_projection_params(d, heads // kv_heads, 1, hd, hd, p["q"].bias is not None, False),
            d if p["o"].bias is not None else 0)


def query_heads(kv_heads: Tensor, groups: int) -> Tensor:
    """The query heads that read the key/value heads ``kv_heads`` (``groups`` query heads each, in order)."""
    return (kv_heads[:, None] * groups + torch.arange(groups)).flatten()


def _rows(weight: Tensor, heads: int, head_dim: int, index: Tensor, kept_heads: Tensor | None = None) -> Tensor:
    """The rows of a (heads x head_dim, ...) projection at ``index`` within every head (of ``kept_heads``
    only, when given)."""
    per_head = weight.reshape(heads, head_dim, *weight.shape[1:])
    if kept_heads is not None:
        per_head = per_head[kept_heads]
    return per_head[:, index].reshape(len(per_head) * len(index), *weight.shape[1:])


def pruned_attention(adapter: DecoderAdapter, i: int, qk_index: Tensor, vo_index: Tensor | None = None,
                     router: nn.Module | None = None, kept_kv_heads: Tensor | None = None) -> PrunedAttention:
    """A ``PrunedAttention`` with the weights of layer ``i``'s attention at the kept head dimensions:
    ``qk_index`` for query/key (pairs, see ``rope_pairs``), and ``vo_index`` (static) or ``router`` (top-K
    per token); ``kept_kv_heads``: the key/value heads kept, each with its query heads (all when None)."""
    reason = head_dim_support(adapter, i)
    if reason is not None:
        raise ValueError(f"cannot prune the head dimension: {reason}")
    if (vo_index is None) == (router is None):
        raise ValueError("give exactly one of vo_index (static) and router (top-K per token)")
    attn, p = adapter.attention_module(i), adapter.attention_projections(i)
    head_dim = attn.head_dim
    d, dense_heads, dense_kv_heads = _geometry(p, head_dim)
    kv_kept = torch.arange(dense_kv_heads) if kept_kv_heads is None else kept_kv_heads.sort().values
    q_kept = query_heads(kv_kept, dense_heads // dense_kv_heads)
    heads, kv_heads = len(q_kept), len(kv_kept)
    spec = {"hidden_size": d, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "qk_index": qk_index.tolist(), "vo_index": None if vo_index is None else vo_index.sort().values.tolist(),
            "router": None if router is None else router.spec(), "bias": p["q"].bias is not None,
            "o_bias": p["o"].bias is not None, "sliding_window": getattr(attn, "sliding_window", None),
            "dense_params": sum(t.numel() for proj in p.values() for t in proj.parameters())}
    if kept_kv_heads is not None:  # which of the dense model's heads these are: exports put them back in place
        spec["kept_kv_heads"] = kv_kept.tolist()
    new = PrunedAttention(spec, attn.config, attn.layer_idx).to(p["q"].weight)
    vo = torch.arange(head_dim) if vo_index is None else torch.tensor(spec["vo_index"])
    with torch.no_grad():
        for role, proj, heads_of, kept, index in (("q", new.q_proj, dense_heads, q_kept, qk_index),
                                                  ("k", new.k_proj, dense_kv_heads, kv_kept, qk_index),
                                                  ("v", new.v_proj, dense_kv_heads, kv_kept, vo)):
            proj.weight.copy_(_rows(p[role].weight, heads_of, head_dim, index, kept))
            if p[role].bias is not None:
                proj.bias.copy_(_rows(p[role].bias, heads_of, head_dim, index, kept))
        new.o_proj.weight.copy_(_rows(p["o"].weight.t(), dense_heads, head_dim, vo, q_kept).t())
        if p["o"].bias is not None:
            new.o_proj.bias.copy_(p["o"].bias)
        if router is not None:
            new.router.load_state_dict(router.state_dict())
    return new
