"""Activated parameters, per layer and in total.

Counted over the projections of attention and MLP (weights and biases), as MoRE's Eq. 16 defines the
activated-parameter ratio: APR = (P_act,attn + E[P_act,mlp]) / (P_attn + P_mlp); embeddings, norms and
the LM head are outside both numerator and denominator. P_act,attn is P_attn unless the head dimension
was pruned (``runtime.attention.PrunedAttention``: narrower Q/K, kept or top-K V/O width per token).
A projection with thresholded inputs (TEAL, ``runtime.sparse_inputs``) activates the weight columns of
the inputs it keeps, measured per token or nominally 1 - its calibrated sparsity.
E[P_act,mlp] is the shared part plus the experts
a token is routed to, averaged over the tokens the layers actually saw (``measured``), or under
uniform routing with the routers' nominal expert count (``nominal``, e.g. CMoE's (S+A)/E). Router parameters are not
part of the dense model, so they are reported separately (``router_params``) and not counted in APR,
as in CMoE's and MoRE's definitions.

Decoder layers a conversion deleted (``moe.depth.remove_layers``, e.g. Dense2MoE's pruned layers) stay
in the dense total, their attention and MLP projections active for no token: their counts are kept in
the ``removed_layers`` list of the model config's ``moeify`` block (saved with the native format),
because the shorter model no longer shows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from moeify.arch import DecoderAdapter
from moeify.arch.standard_moe import DENSE_REFERENCE_KEY, decoder_layers, is_standard_moe, layer_counts
from moeify.files import MOEIFY_KEY
from moeify.runtime.attention import PrunedAttention
from moeify.runtime.moe import MoeMLP
from moeify.runtime.sparse_inputs import ThresholdedLinear


def _neuron_params(layer: MoeMLP) -> int:
    """Parameters owned by one hidden neuron of this layer (a row of up/gate, a column of down, biases)."""
    n = layer.neuron_layout
    per = n.up.in_features * (3 if n.gated else 2)
    return per + (0 if n.up.bias is None else (2 if n.gated else 1))


def _dense_mlp_params(layer: MoeMLP) -> int:
    """The parameters of the dense MLP that ``layer`` was made from."""
    return layer.dense_width * _neuron_params(layer) + (0 if layer.down_bias is None else layer.down_bias.numel())


def moe_layer_counts(layer: MoeMLP, measured: bool) -> tuple[int, float, int]:
    """(dense-equivalent MLP params, expected active MLP params per token, router params)."""
    per = _neuron_params(layer)
    widths = layer.expert_widths
    shared = 0 if layer.shared is None else layer.shared.width
    bias = 0 if layer.down_bias is None else layer.down_bias.numel()
    dense = _dense_mlp_params(layer)
    if layer.router is None:
        return dense, shared * per + bias, 0
    if measured and layer.stats_tokens:
        routed = sum(c * w for c, w in zip(layer.stats_expert_tokens.tolist(), widths)) / layer.stats_tokens
    else:
        expected = layer.router.expected_experts()
        if expected is None:
            raise ValueError(f"the {layer.router.kind} router has no nominal expert count; measure the routing "
                             "on data first (tracking_routing)")
        routed = expected * sum(widths) / len(widths)
    router = sum(p.numel() for p in layer.router.parameters())
    return dense, (shared + routed) * per + bias, router


@dataclass(frozen=True)
class ActiveParams:
    """The record's ``active`` block."""

    total_params: int          # P_attn + P_mlp of the dense model
    active_params: float       # P_attn + E[P_act,mlp]
    apr: float                 # active_params / total_params (MoRE Eq. 16)
    mlp_ratio: float           # E[P_act,mlp] / P_mlp
    router_params: int
    per_layer_mlp_ratio: list[float]
    measured: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_mlp_counts(adapter: DecoderAdapter, i: int, measured: bool) -> tuple[float, float, int]:
    """(dense-equivalent MLP params, expected active MLP params per token, router params) of layer ``i``."""
    module = adapter.mlp_module(i)
    if isinstance(module, MoeMLP):
        return moe_layer_counts(module, measured)
    dense = adapter.dense_mlp_params(i)
    return dense, dense - unused_columns(module, measured), 0


def unused_columns(module: nn.Module, measured: bool) -> float:
    """Weights per token that thresholded inputs (TEAL) leave out of ``module``'s projections."""
    return sum(m.weight.numel() * (1.0 - m.kept_fraction(measured))
               for m in module.modules() if isinstance(m, ThresholdedLinear))


def layer_attention_counts(adapter: DecoderAdapter, i: int, measured: bool) -> tuple[int, float, int]:
    """(dense attention params, active attention params per token, router params) of layer ``i``: a
    ``PrunedAttention`` (ToMoE, static_prune) activates narrower Q/K and the kept or top-K V/O width."""
    module = adapter.attention_module(i)
    if isinstance(module, PrunedAttention):
        router = 0 if module.router is None else sum(p.numel() for p in module.router.parameters())
        return module.dense_params, module.active_params(), router
    dense = adapter.attention_params(i)
    return dense, dense - unused_columns(module, measured), 0


def removed_layers(model: nn.Module) -> list[dict[str, int]]:
    """The layers deleted from ``model`` with their projection counts (see the module docstring)."""
    return list((getattr(model.config, MOEIFY_KEY, None) or {}).get("removed_layers", []))


def activated_parameters(model: nn.Module, measured: bool = True) -> ActiveParams:
    """Count the model's activated parameters (see the module docstring); a MoE architecture of
    transformers' own (a standard export) is counted by ``standard_moe``. A model exported from a
    conversion is measured against the dense model it came from (``standard_moe.DENSE_REFERENCE_KEY``)."""
    if is_standard_moe(model):
        return _standard_moe_parameters(model)
    adapter = DecoderAdapter(model)
    attn = attn_active = mlp_dense = mlp_active = 0.0
    router = 0
    per_layer = []
    any_measured = False
    for i in range(adapter.num_layers):
        dense_attn, active_attn, r = layer_attention_counts(adapter, i, measured)
        attn += dense_attn
        attn_active += active_attn
        router += r
        dense, active, r = layer_mlp_counts(adapter, i, measured)
        module = adapter.mlp_module(i)
        any_measured |= measured and any(_has_stats(m) for m in (module, adapter.attention_module(i)))
        router += r
        mlp_dense += dense
        mlp_active += active
        per_layer.append(active / dense)
    removed = removed_layers(model)  # in the dense total, never active
    mlp_dense += sum(entry["mlp_params"] for entry in removed)
    total = attn + sum(entry["attention_params"] for entry in removed) + mlp_dense
    if reference := getattr(model.config, DENSE_REFERENCE_KEY, None):  # a dense export of a pruned model
        mlp_dense, total = reference["mlp_params"], reference["attention_params"] + reference["mlp_params"]
    active = attn_active + mlp_active
    return ActiveParams(total_params=int(total), active_params=active, apr=active / total,
                        mlp_ratio=mlp_active / mlp_dense, router_params=router,
                        per_layer_mlp_ratio=per_layer, measured=any_measured)


def dense_reference(model: nn.Module) -> dict[str, int]:
    """The attention and MLP projection counts of the dense model ``model`` came from (removed layers
    included): APR's denominator, which a standard export carries in its config (``standard_moe``)."""
    adapter = DecoderAdapter(model)
    removed = removed_layers(model)
    attention = sum(layer_attention_counts(adapter, i, False)[0] for i in range(adapter.num_layers))
    mlp = sum(_dense_mlp_params(m) if isinstance(m := adapter.mlp_module(i), MoeMLP) else adapter.dense_mlp_params(i)
              for i in range(adapter.num_layers))
    return {"attention_params": int(attention + sum(e["attention_params"] for e in removed)),
            "mlp_params": int(mlp + sum(e["mlp_params"] for e in removed))}


def _standard_moe_parameters(model: nn.Module) -> ActiveParams:
    """``ActiveParams`` of a transformers MoE architecture (``standard_moe``); every token runs top_k
    experts, so nominal and measured agree. ``per_layer_mlp_ratio``: active / stored MLP parameters."""
    counts = [layer_counts(layer, model.config.num_experts_per_tok) for layer in decoder_layers(model)]
    attention, mlp_active = sum(c[0] for c in counts), sum(c[1] for c in counts)
    reference = getattr(model.config, DENSE_REFERENCE_KEY, None) or {
        "attention_params": attention, "mlp_params": sum(c[3] for c in counts)}
    total = reference["attention_params"] + reference["mlp_params"]
    return ActiveParams(total_params=int(total), active_params=attention + mlp_active,
                        apr=(attention + mlp_active) / total, mlp_ratio=mlp_active / reference["mlp_params"],
                        router_params=sum(c[2] for c in counts),
                        per_layer_mlp_ratio=[c[1] / c[3] for c in counts], measured=False)


# kind -> (the label printed beside the value, the definition recorded with it)
PAPER_RATIOS = {
    "ffn": ("FFN only", "activated FFN parameters / FFN parameters (CMoE counts the converted FFN only)"),
    "apr": ("attention + MLP, routing measured",
            "activated attention + MLP projection parameters / all of them, on the evaluation tokens (ToMoE)"),
    "uniform": ("attention + MLP, uniform routing",
                ("activated attention + MLP projection parameters / all of them, every expert chosen equally "
                 "often (MoRE Eq. 16, App. F.2)")),
    "model": ("whole model", ("activated parameters / all parameters, embeddings, norms and LM head included "
                              "(DSMoE, Dense2MoE)")),
}


def paper_ratio(model: nn.Module, active: ActiveParams, kind: str) -> dict[str, Any]:
    """The activated ratio as a method's own paper defines it (``PAPER_RATIOS``), from ``active``. For
    ``uniform``, the routers' nominal expert counts over experts of mean width (``measured=False``), whatever
    the routing on data was. For ``model``, the parameters outside the attention and MLP modules (embeddings,
    norms, LM head; a tied head once) count as always active, in numerator and denominator; a removed layer's
    norms are not counted (a few thousand parameters)."""
    if kind == "ffn":
        value = active.mlp_ratio
    elif kind == "apr":
        value = active.apr
    elif kind == "uniform":
        value = activated_parameters(model, measured=False).apr
    elif kind == "model":
        adapter = DecoderAdapter(model)
        inner = {id(p) for i in range(adapter.num_layers)
                 for m in (adapter.attention_module(i), adapter.mlp_module(i)) for p in m.parameters()}
        other = sum(p.numel() for p in model.parameters() if id(p) not in inner)
        value = (active.active_params + other) / (active.total_params + other)
    else:
        raise ValueError(f"paper ratio {kind!r} is unknown; known: {', '.join(PAPER_RATIOS)}")
    label, definition = PAPER_RATIOS[kind]
    return {"kind": kind, "label": label, "definition": definition, "value": value}


def nominal_activated_parameters(model: nn.Module) -> ActiveParams | None:
    """``activated_parameters`` under the routers' nominal expert counts; None when a router has none
    (its expert count depends on the data, like DSMoE's threshold router)."""
    routers = [layer.router for layer in moe_layers(model) if layer.router is not None]
    if any(router.expected_experts() is None for router in routers):
        return None
    return activated_parameters(model, measured=False)


def _has_stats(module: nn.Module) -> bool:
    """Whether ``module`` counted routed tokens or kept inputs on data."""
    if isinstance(module, MoeMLP):
        return module.stats_tokens > 0
    return any(m.stats_inputs > 0 for m in module.modules() if isinstance(m, ThresholdedLinear))


def moe_layers(model: nn.Module) -> list[MoeMLP]:
    return [m for m in model.modules() if isinstance(m, MoeMLP)]


@contextmanager
def tracking_routing(model: nn.Module) -> Iterator[list[MoeMLP]]:
    """Count tokens per expert in every MoE layer, and kept inputs in every thresholded projection, inside
    the block (counters reset on entry); yields the MoE layers."""
    layers = moe_layers(model)
    counters = [*layers, *(m for m in model.modules() if isinstance(m, ThresholdedLinear))]
    for counter in counters:
        counter.reset_stats()
        counter.track_stats = True
    try:
        yield layers
    finally:
        for counter in counters:
            counter.track_stats = False


def attention_share(adapter: DecoderAdapter) -> float:
    """P_attn / (P_attn + P_mlp) of the dense model: the lowest APR a model with dense attention reaches."""
    attn = sum(adapter.attention_params(i) for i in range(adapter.num_layers))
    mlp = sum(adapter.dense_mlp_params(i) for i in range(adapter.num_layers))
    return attn / (attn + mlp)


def mlp_share_for_apr(apr: float, adapter: DecoderAdapter) -> float:
    """The share of every MLP that must stay active for the model to reach activated-parameter ratio
    ``apr`` with its attention dense: (apr (P_attn + P_mlp) - P_attn) / P_mlp."""
    floor = attention_share(adapter)
    return (apr - floor) / (1 - floor)
