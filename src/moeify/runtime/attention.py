"""Attention with a pruned head dimension, as run at inference (ToMoE §3.3 and the static-prune baseline).

Part of the runtime copied into every converted folder, like ``moe.py`` (only torch and transformers).

``PrunedAttention`` replaces a LLaMA-style attention (separate q/k/v/o projections, rotary embedding on
the whole head): every head keeps the same head dimensions. It may keep fewer heads than the dense model
(ToMoE's head pruning): whole key/value heads with their query heads, which the spec's ``kept_kv_heads``
names among the dense model's (exports put them back in place, the others zero).

- Query and key keep the static dimensions ``qk_index`` (ToMoE's s_0). RoPE rotates dimension i with
  i + head_dim/2, so ``qk_index`` must hold both dimensions of every pair it keeps (ToMoE Appendix A.2);
  the projections are physically narrower and the rotary cos/sin are gathered at the kept dimensions.
  The softmax scaling stays 1/sqrt(original head_dim): the scores are the dense scores minus the pruned
  dimensions' terms, nothing else.
- Value and output keep either static dimensions ``vo_index`` (narrower projections), or, with a
  ``HeadDimRouter``, the top-K dimensions chosen per token (ToMoE Eq. 4-5): token t's value is zero
  outside its K dimensions, and the output projection reads only its K dimensions of the attention
  output. Both are computed as the dense value/output products times each token's 0/1 mask of its
  dimensions (the form of ToMoE Appendix B.3): the function of computing only the kept dimensions.
  Computing only those was measured slower on CPU at every token count from one to 512 (one layer of
  SmolLM2's shape, float32): one small product per head dimension over the tokens that kept it took
  several times to over an order of magnitude longer than the masked products, gathering each token's
  weight rows several times as long at one to four tokens and more beyond. Selecting rows of projections
  this small costs more than the half of them it skips. The activated parameters count the K dimensions
  (the paper's definition). The value cache stores full-width heads with zeros outside each token's
  dimensions, because the attention mixes tokens with different selections.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _one_width(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value zero-padded to one head width (the wider of q/k and v). Fused attention kernels
    (SDPA's flash and memory-efficient ones, FlashAttention) take one width for all three; with two, SDPA
    falls back to its unfused math (scores materialised, the causal mask built), slower on a CPU
    (``benchmarks/bench_tomoe_speed.py``) as on a GPU. Zero dimensions add nothing to a score, and
    the output's padded dimensions are zero and cut off, so the attention computes the same function; the
    cache then holds keys and values of that one width, no wider than the dense model's heads."""
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda t: t if t.shape[-1] == width else nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    return pad(q), pad(k), pad(v)


class HeadDimRouter(nn.Module):
    """ToMoE's Eq. 5 after conversion: Proj_D(Proj_E(x) + mean expert embedding) -> the top-K head
    dimensions per token. The mean expert embedding lives in ``proj_e``'s bias (§3.5); Proj_D is
    LayerNorm -> GeLU -> Linear (Table 8)."""

    kind = "tomoe_head_dim"

    def __init__(self, hidden_size: int, head_dim: int, embed_dim: int, top_k: int) -> None:
        super().__init__()
        self.proj_e = nn.Linear(hidden_size, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)
        self.proj_d = nn.Linear(embed_dim, head_dim)
        self.top_k = top_k

    def logits(self, x: Tensor) -> Tensor:
        return self.proj_d(nn.functional.gelu(self.norm(self.proj_e(x))))

    def forward(self, x: Tensor) -> Tensor:
        """(..., top_k) indices of the kept head dimensions of every token, ascending."""
        return self.logits(x).topk(self.top_k, dim=-1).indices.sort(dim=-1).values

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "embed_dim": self.proj_e.out_features, "top_k": self.top_k}


def pruned_projection_params(hidden: int, heads: int, kv_heads: int, qk_dims: int, vo_width: int, qkv_bias: bool,
                             o_bias: bool) -> int:
    """Projection parameters one token uses in an attention whose every head keeps ``qk_dims`` query/key
    dimensions and ``vo_width`` value/output dimensions."""
    qk = (heads + kv_heads) * qk_dims * (hidden + int(qkv_bias))
    vo = vo_width * (heads + kv_heads) * hidden + (vo_width * kv_heads if qkv_bias else 0)
    return qk + vo + (hidden if o_bias else 0)


class PrunedAttention(nn.Module):
    """See the module docstring. ``spec()`` rebuilds the structure; the weights come from safetensors."""

    def __init__(self, spec: dict[str, Any], config: Any, layer_idx: int) -> None:
        super().__init__()
        d, heads, kv_heads = spec["hidden_size"], spec["num_heads"], spec["num_kv_heads"]
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = spec["head_dim"]
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.num_key_value_groups = heads // kv_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.attention_dropout = 0.0
        self.sliding_window = spec.get("sliding_window")
        self.dense_params = spec["dense_params"]
        self.register_buffer("qk_index", torch.tensor(spec["qk_index"], dtype=torch.long))
        qk = len(spec["qk_index"])
        self.router = None
        if spec["router"] is not None:
            router = dict(spec["router"])
            router.pop("kind")
            self.router = HeadDimRouter(d, self.head_dim, **router)
            self.vo_index = None
            vo = self.head_dim
        else:
            self.register_buffer("vo_index", torch.tensor(spec["vo_index"], dtype=torch.long))
            vo = len(spec["vo_index"])
        bias = spec["bias"]
        self.q_proj = nn.Linear(d, heads * qk, bias=bias)
        self.k_proj = nn.Linear(d, kv_heads * qk, bias=bias)
        self.v_proj = nn.Linear(d, kv_heads * vo, bias=bias)
        self.o_proj = nn.Linear(heads * vo, d, bias=spec["o_bias"])
        self._spec = dict(spec)

    def spec(self) -> dict[str, Any]:
        return dict(self._spec)

    def active_params(self) -> int:
        """Projection parameters one token uses: narrower q/k, and v/o at the kept (or top-K) width."""
        vo_width = self.router.top_k if self.router is not None else len(self.vo_index)
        return pruned_projection_params(self.hidden_size, self.num_heads, self.num_kv_heads, len(self.qk_index),
                                        vo_width, self.v_proj.bias is not None, self.o_proj.bias is not None)

    @property
    def hidden_size(self) -> int:
        return self.q_proj.in_features

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
                attention_mask: Tensor | None = None, cache: Any = None, past_key_values: Any = None, **kwargs: Any):
        cache = cache if cache is not None else past_key_values  # transformers >= 5.24 names it ``cache``
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.num_kv_heads, -1).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos[..., self.qk_index].unsqueeze(1), sin[..., self.qk_index].unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        kept = None if self.router is None else self._kept(hidden_states)  # (b, t, 1, head_dim) 0/1
        v = self.v_proj(hidden_states).view(b, t, self.num_kv_heads, -1)
        v = (v if kept is None else v * kept).transpose(1, 2)
        vo = v.shape[-1]
        q, k, v = _one_width(q, k, v)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        if interface is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as interface
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                 sliding_window=self.sliding_window, **kwargs)
        out = out[..., :vo].reshape(b, t, self.num_heads, -1)  # transformers' interfaces return (b, t, heads, dims)
        return self.o_proj((out if kept is None else out * kept).reshape(b, t, -1)), weights

    def _kept(self, x: Tensor) -> Tensor:
        """Each token's 0/1 mask of the value/output dimensions its router keeps, (b, t, 1, head_dim): one
        mask for the value states and the attention output, broadcast over the heads. Where the router
        trains (a recovery after the conversion), the mask is m + s - sg(s), s = sigmoid of its logits:
        still 0/1 exactly, with the sigmoid's straight-through gradient that ToMoE trained it with (Eq. 15)."""
        selected = self.router(x)  # (b, t, K)
        mask = torch.zeros(*selected.shape[:-1], self.head_dim, dtype=self.v_proj.weight.dtype, device=x.device)
        mask = mask.scatter(-1, selected, 1.0)
        if torch.is_grad_enabled() and self.router.proj_d.weight.requires_grad:
            soft = torch.sigmoid(self.router.logits(x).float())
            mask = mask + (soft - soft.detach()).to(mask.dtype)
        return mask[:, :, None, :]


def install_pruned_attention(model: nn.Module, moeify_block: dict[str, Any]) -> None:
    """Replace the attention modules listed under ``moeify_block["attention"]`` ({path: spec})."""
    for path, spec in (moeify_block.get("attention") or {}).items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, name)
        setattr(parent, name, PrunedAttention(spec, model.config, getattr(old, "layer_idx", 0)))


def pruned_attention_specs(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {name: module.spec() for name, module in model.named_modules() if isinstance(module, PrunedAttention)}
