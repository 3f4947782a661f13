"""Dense2MoE's selection (§2.3) and Layer-Fusion Upcycling (Eq. 6) as plain functions; the choices are
explained in ``moeify.methods.dense2moe``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from moeify.arch import DecoderAdapter
from moeify.arch.mlp import MlpWeights
from moeify.moe.depth import remove_layers
from moeify.moe.experts.build import expert_mlp
from moeify.options import OptionError
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import SoftmaxTopKRouter


@dataclass(frozen=True)
class Span:
    """Keep layer ``layer`` (l*) and fuse the ``n`` (n*) layers after it. ``layer_output_similarity`` is
    s(x^(l*), x^(l*+n*)); ``mlp_input_distance`` the largest 1 - s(h^(l*), h^(l*+k)), k = 1 .. n*."""

    layer: int
    n: int
    layer_output_similarity: float
    mlp_input_distance: float

    @property
    def removed(self) -> list[int]:
        return list(range(self.layer + 1, self.layer + self.n + 1))

    @property
    def layers(self) -> set[int]:
        """The kept layer and the removed ones: what another span must not touch."""
        return set(range(self.layer, self.layer + self.n + 1))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "removed": self.removed}


def rank_spans(s_l: list[list[float]], s_m: list[list[float]], prune_layers: int | None = None) -> list[Span]:
    """Every span (l, n), l + n < N (only n = ``prune_layers`` if given), by S_L descending (§2.3); ties
    go to the earlier layer, then to the shorter span."""
    layers = len(s_l)
    spans = [Span(l, n, s_l[l][l + n], max(1.0 - s_m[l][l + k] for k in range(1, n + 1)))
             for l in range(layers - 1) for n in range(1, layers - l) if prune_layers in (None, n)]
    return sorted(spans, key=lambda span: (-span.layer_output_similarity, span.layer, span.n))


def select_span(s_l: list[list[float]], s_m: list[list[float]], delta: float, prune_layers: int | None,
                taken: frozenset[int] = frozenset()) -> Span:
    """The first span in S_L order whose fused MLP inputs are all within distance ``delta`` of h^(l*) and
    that touches none of the layers in ``taken``."""
    spans = [span for span in rank_spans(s_l, s_m, prune_layers) if not span.layers & taken]
    if not spans:
        raise OptionError(f"no span of {prune_layers} layers is left beside the spans already chosen (layers "
                          f"{sorted(taken)}): fewer spans or fewer prune_layers")
    for span in spans:
        if span.mlp_input_distance < delta:
            return span
    closest = min(spans, key=lambda span: span.mlp_input_distance)
    raise OptionError(f"delta={delta}: no span{'' if prune_layers is None else f' of {prune_layers} layers'} has "
                      f"every MLP-input distance 1 - s(h) below it; the closest is {closest.mlp_input_distance:.4f} "
                      f"(layer {closest.layer}, n={closest.n}): raise delta above it")


def select_spans(s_l: list[list[float]], s_m: list[list[float]], delta: float, sizes: list[int]) -> list[Span]:
    """One span per size, chosen greedily (largest first, each the first in S_L order that qualifies) with
    no layer in common: the "top-k redundant layers" of §4.1 need not be contiguous. In layer order."""
    chosen: list[Span] = []
    for size in sizes:
        chosen.append(select_span(s_l, s_m, delta, size, frozenset().union(*(span.layers for span in chosen))))
    return sorted(chosen, key=lambda span: span.layer)


def fold_mlp_norm(mlp: MlpWeights, kept: tuple[Tensor, Tensor | None], own: tuple[Tensor, Tensor | None]) -> MlpWeights:
    """``mlp`` behind its own norm, re-expressed on the output of the kept layer's norm of the same input:
    own(h) = (kept(h) - b_kept) * r + b_own = kept(h) * r + c with r = w_own / w_kept (both norms share
    the normalisation statistic of h), so W <- W diag(r) and b <- b + W c for up and gate. Exact."""
    (w_kept, b_kept), (w_own, b_own) = kept, own
    if bool((w_kept == 0).any()):
        raise ValueError("the kept layer's MLP norm has zero weights: the removed layers' norms cannot be folded")
    ratio = w_own.float() / w_kept.float()  # r: (d,)
    zero = torch.zeros_like(ratio)
    shift = (zero if b_own is None else b_own.float()) - ratio * (zero if b_kept is None else b_kept.float())  # c
    if bool(shift.ne(0).any()) and mlp.up_bias is None:
        raise ValueError("the MLP norms have biases but the MLP has none: the norms cannot be folded")

    def weight(w: Tensor | None) -> Tensor | None:
        return None if w is None else (w.float() * ratio).to(w.dtype)

    def bias(b: Tensor | None, w: Tensor | None) -> Tensor | None:
        return None if b is None else (b.float() + w.float() @ shift).to(b.dtype)

    return replace(mlp, up=weight(mlp.up), gate=weight(mlp.gate), up_bias=bias(mlp.up_bias, mlp.up),
                   gate_bias=bias(mlp.gate_bias, mlp.gate))


def expert_sources(span: Span, variant: str, num_copies: int, copies_per_pruned: int) -> list[int]:
    """The layer whose MLP each expert copies: ``lfuc``, N copies of l*'s and M of each removed layer's
    (Eq. 6); ``prune_upcycle``, as many copies of l*'s alone (Table 5's baseline); ``prune_only``, none."""
    if variant == "prune_only":
        return []
    fused = [layer for layer in span.removed for _ in range(copies_per_pruned)]
    if variant == "prune_upcycle":
        return [span.layer] * (num_copies + len(fused))
    return [span.layer] * num_copies + fused


def fuse_layers_(model: nn.Module, spans: list[Span], sources: list[list[int]], top_k: int, seed: int,
                 paper_weighting: bool = False) -> list[dict[str, int]]:
    """For each span, put the MoE of its ``sources`` (if any) in layer l*'s MLP slot; then remove every
    span's layers l*+1 .. l*+n* entirely; returns the removed layers' records (``moe.depth``).
    ``paper_weighting``: experts weighted by p_i (§2.1) instead of p_i E / k."""
    for index, (span, span_sources) in enumerate(zip(spans, sources)):
        _fuse_span_(model, span, span_sources, top_k, seed + index, paper_weighting)
    return remove_layers(model, sorted(layer for span in spans for layer in span.removed))


def _fuse_span_(model: nn.Module, span: Span, sources: list[int], top_k: int, seed: int,
                paper_weighting: bool) -> None:
    adapter = DecoderAdapter(model)
    if sources:
        kept, kept_norm = adapter.mlp(span.layer), adapter.mlp_norm_affine(span.layer)
        experts = [expert_mlp(kept if s == span.layer else fold_mlp_norm(adapter.mlp(s), kept_norm,
                                                                           adapter.mlp_norm_affine(s)))
                   for s in sources]
        router = SoftmaxTopKRouter(kept.hidden_size, len(experts), top_k, scale=1.0 if paper_weighting else None)
        std = getattr(model.config, "initializer_range", 0.02)  # as the model initialises its own linears
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            router.proj.weight.copy_(torch.randn(router.proj.weight.shape, generator=generator) * std)
        down_bias = None if kept.down_bias is None else kept.down_bias.detach().clone()
        layer = MoeMLP(experts, router, None, down_bias, dense_width=kept.intermediate_size)
        adapter.replace_mlp_(span.layer, layer.to(device=kept.up.device, dtype=kept.up.dtype))
