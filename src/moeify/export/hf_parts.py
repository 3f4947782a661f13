"""Every decoder layer's MLP as the pieces a standard MoE checkpoint stores, whatever the method made it.

Standard formats (``glm4_moe``, ``qwen2_moe``, ``mixtral``) know only gated MLPs without biases, an
optional always-on part, equal-width routed experts and a *linear* router whose scores are ``x @ W.T``.
``layer_parts`` reduces a converted model to exactly that (``LayerParts``), or says, per layer, why it
cannot; ``fold`` then reshapes one layer to the widths a format fixes for all layers without changing
what it computes. Nothing here knows a format's module names: that is ``formats``' business.

Which routers are linear, each router says itself (``linear_form()``, see ``runtime.routers``); an
export measures the logits to show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from moeify.arch import DecoderAdapter
from moeify.moe.attention.head_dim import query_heads
from moeify.runtime.attention import PrunedAttention
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import NotLinear, Router
from moeify.runtime.sparse_inputs import ThresholdedLinear

Weighting = Literal["unit", "softmax", "renormalised", "sigmoid"]
APPROXIMATE_HINT = "; --approximate exports its closest form (measured and reported as an approximation)"
SUPPORTED_ACT = "silu"  # the only MLP activation vLLM's MoE kernels implement for these formats


class NotRepresentable(ValueError):
    """A part of the model that no standard format computes; ``approximable`` when ``Approximation`` has a
    closest form of it (``moeify export --approximate``). ``where``: the layer, once known."""

    def __init__(self, reason: str, approximable: bool = False, where: str = "") -> None:
        super().__init__(f"{where}: {reason}" if where else reason)
        self.reason, self.approximable, self.where = reason, approximable, where

    def at(self, where: str) -> "NotRepresentable":
        return NotRepresentable(self.reason, self.approximable, where)


def grouped_reasons(errors: list[NotRepresentable]) -> list[str]:
    """One line per distinct reason, naming every layer it applies to (five CMoE layers: one line)."""
    layers: dict[str, list[str]] = {}
    for error in errors:
        layers.setdefault(error.reason, []).append(error.where)
    return [f"{', '.join(where)}: {reason}" if any(where) else reason for reason, where in layers.items()]


@dataclass(frozen=True)
class GatedMlp:
    """``down(silu(gate x) * up x)`` as plain tensors in ``nn.Linear`` layout: gate/up (w, d), down (d, w)."""

    gate: Tensor
    up: Tensor
    down: Tensor

    @property
    def width(self) -> int:
        return self.up.shape[0]

    @staticmethod
    def empty(hidden: int, like: Tensor) -> "GatedMlp":
        rows = like.new_zeros(0, hidden)
        return GatedMlp(rows, rows, like.new_zeros(hidden, 0))

    def cat(self, other: "GatedMlp") -> "GatedMlp":
        """Both neuron sets side by side: computes self(x) + other(x)."""
        return GatedMlp(torch.cat([self.gate, other.gate]), torch.cat([self.up, other.up]),
                        torch.cat([self.down, other.down], dim=1))

    def __call__(self, x: Tensor) -> Tensor:
        """The MLP on ``x`` (..., d), in x's dtype."""
        gate, up, down = (t.to(x.dtype) for t in (self.gate, self.up, self.down))
        return nn.functional.linear(nn.functional.silu(x @ gate.T) * (x @ up.T), down)

    def padded(self, width: int) -> "GatedMlp":
        """Zero neurons appended up to ``width``: a zero up row gives h = 0 and a zero down column adds 0,
        so the function is unchanged (exactly, for any activation)."""
        extra = width - self.width
        if extra < 0:
            raise ValueError(f"cannot pad width {self.width} down to {width}")
        return GatedMlp(nn.functional.pad(self.gate, (0, 0, 0, extra)), nn.functional.pad(self.up, (0, 0, 0, extra)),
                        nn.functional.pad(self.down, (0, extra)))


@dataclass(frozen=True)
class Routing:
    """A linear router: scores ``x @ weight.T`` (weight (experts, d)), the ``top_k`` best experts run.

    ``weighting``: ``"unit"``, every chosen expert weighs 1 (MoRE, CMoE with u = 0); ``"softmax"``, it
    weighs its softmax probability over all experts, not renormalised (Dense2MoE's g_i); ``"renormalised"``,
    its softmax probability renormalised over the chosen k (qwen2_moe's ``norm_topk_prob``, Mixtral);
    ``"sigmoid"``, sigma(score) (DSMoE's gate g_i; glm4_moe without ``norm_topk_prob``).
    ``expert_scale``: a constant factor of every routed expert's weight, folded into the experts' down
    projections (Dense2MoE's E / k; k for distilled unit top-k routers, see ``hf_distill``).
    ``approximate``: not the model's own router but its closest linear top-k one (``--approximate``)."""

    weight: Tensor
    top_k: int
    weighting: Weighting
    approximate: bool = False
    expert_scale: float = 1.0


@dataclass(frozen=True)
class Approximation:
    """What an export computes in place of what no format does (``moeify export --approximate``, built by
    ``export.approximate``): ``routings`` replace routers by layer path, ``attention_dims`` give a
    per-token attention (ToMoE's value/output dimensions) static dimensions by module path, and
    ``drop_thresholds`` exports thresholded projections (TEAL) as the dense ones they wrap, and
    ``dense_layers`` (layer indices) export those routed layers as dense MLPs of every neuron they hold
    (``dense_form``)."""

    routings: dict[str, Routing] = field(default_factory=dict)
    attention_dims: dict[str, Tensor] = field(default_factory=dict)
    drop_thresholds: bool = False
    dense_layers: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.routings or self.attention_dims or self.drop_thresholds or self.dense_layers)


EXACT = Approximation()


@dataclass(frozen=True)
class LayerParts:
    """Layer ``index``'s MLP: ``shared`` runs on every token (the whole MLP of a dense layer), ``experts``
    are routed by ``routing`` (None: nothing is routed). ``input_bound`` bounds |x| at the MLP input
    (sqrt(d) max|gamma| after an RMSNorm), so a sigmoid router's scores can be kept off saturation."""

    index: int
    path: str
    shared: GatedMlp
    experts: tuple[GatedMlp, ...]
    routing: Routing | None
    input_bound: float

    @property
    def routed(self) -> bool:
        return self.routing is not None

    @property
    def neurons_per_token(self) -> float:
        """MLP neurons a token runs here: the shared part and the top-k experts at their mean width (a format's
        layout pads them to one width)."""
        routed = self.routing.top_k * sum(e.width for e in self.experts) / len(self.experts) if self.routed else 0
        return self.shared.width + routed

    def record(self) -> dict[str, Any]:
        """The layer as an export's record lists it: widths and routing."""
        return {"path": self.path, "routed": self.routed, "shared_width": self.shared.width,
                "expert_widths": [e.width for e in self.experts],
                "routing": None if self.routing is None else {"top_k": self.routing.top_k,
                                                              "weighting": self.routing.weighting,
                                                              "approximate": self.routing.approximate}}


def linear_routing(router: Router) -> Routing:
    """The router's own ``linear_form()`` as a ``Routing`` with its ``expert_scale`` (1 but for Dense2MoE's
    E / k); or ``NotRepresentable`` saying why the router is not linear (``approximable`` when a fitted
    linear router would make the model exportable, approximately)."""
    try:
        form = router.linear_form()
    except NotLinear as error:
        hint = APPROXIMATE_HINT if error.approximable else ""
        raise NotRepresentable(f"router {router.kind!r} {error.reason}{hint}",
                               approximable=error.approximable) from None
    return Routing(form.weight, form.top_k, form.weighting, expert_scale=float(router.expert_scale))


def _gated(weights: tuple[Tensor | None, Tensor, Tensor], what: str) -> GatedMlp:
    gate, up, down = weights
    if gate is None:
        raise NotRepresentable(f"{what} is a two-layer MLP; standard MoE formats need gated (SwiGLU) MLPs")
    return GatedMlp(gate.detach(), up.detach(), down.detach())


def _module_part(expert: nn.Module, what: str) -> GatedMlp:
    neurons = expert.neurons
    if neurons.up.bias is not None:
        raise NotRepresentable(f"{what} has biases in its up/gate projections; standard formats have none")
    gate = None if neurons.gate is None else neurons.gate.weight
    return _gated((gate, neurons.up.weight, expert.down.weight), what)


def _input_bound(adapter: DecoderAdapter, i: int, hidden: int) -> float:
    gamma, _ = adapter.mlp_norm_affine(i)
    scale = float(gamma.abs().max())
    return hidden ** 0.5 * scale


def _moe_parts(module: MoeMLP, routing: Routing | None) -> tuple[GatedMlp | None, tuple, Routing | None]:
    shared = None if module.shared is None else _module_part(module.shared, "the shared part")
    experts = tuple(_module_part(e, f"expert {n}") for n, e in enumerate(module.expert_modules()))
    act = module.neuron_layout.act_name
    if act != SUPPORTED_ACT:
        raise NotRepresentable(f"the MoE layer uses activation {act!r}; exportable: {SUPPORTED_ACT!r}")
    if module.down_bias is not None:
        raise NotRepresentable("the MoE layer has an output bias; standard formats have none")
    if module.router is not None and routing is None:
        routing = linear_routing(module.router)
    if routing is not None and routing.expert_scale != 1.0:  # a constant on every routed weight: on every output
        experts = tuple(replace(e, down=e.down * routing.expert_scale) for e in experts)
    return shared, experts, routing


def dense_form(module: MoeMLP) -> GatedMlp:
    """A routed layer as the dense MLP of every neuron it holds, each once, weighing 1: the layer with
    every expert on (experts that overlap, ToMoE's, give their union). It runs what each token ran and the
    other experts' neurons beside it, so it is a close form of a layer that keeps most of its neurons for
    every token (a ToMoE layer whose experts share nearly all of them), where a format's global widths
    would pad every other layer to its width. Only for experts that weigh 1 when chosen: other weights
    have no all-on form."""
    shared, experts, _ = _moe_parts(module, None)
    routing = linear_routing(module.router)
    if routing.weighting != "unit" or routing.expert_scale != 1.0:
        raise NotRepresentable(f"a dense form needs experts that weigh 1 when chosen; this router's weigh "
                               f"{routing.weighting!r} x {routing.expert_scale:g}")
    whole = shared if shared is not None else GatedMlp.empty(experts[0].up.shape[1], experts[0].up)
    if module.shares_neurons:  # the union, stored once: the neurons some expert runs
        store, used = _module_part(module.experts, "the experts"), module.experts.index.unique().long()
        return whole.cat(GatedMlp(store.gate[used], store.up[used], store.down[:, used]))
    for expert in experts:
        whole = whole.cat(expert)
    return whole


def thresholds_reason(module: nn.Module, approximation: Approximation) -> NotRepresentable | None:
    """Why ``module``'s thresholded projections (TEAL) are not exported, unless dropped by ``approximation``."""
    if approximation.drop_thresholds or not any(isinstance(m, ThresholdedLinear) for m in module.modules()):
        return None
    return NotRepresentable("zeroes projection inputs below a threshold (activation sparsity); no format or engine "
                            "computes that" + APPROXIMATE_HINT + " (the dense weights)", approximable=True)


def layer_parts(model: nn.Module, approximation: Approximation = EXACT
                ) -> tuple[list[LayerParts], list[NotRepresentable]]:
    """Every layer as ``LayerParts``, and why (one error per layer that cannot be) it is not possible.

    ``approximation`` replaces the routers of the layers it names (paths as in the native config) and may
    drop input thresholds."""
    adapter = DecoderAdapter(model)
    hidden = model.config.hidden_size
    parts: list[LayerParts] = []
    errors: list[NotRepresentable] = []
    for i in range(adapter.num_layers):
        where = adapter.mlp_path(i)
        try:
            module = adapter.mlp_module(i)
            if (reason := thresholds_reason(module, approximation)) is not None:
                raise reason
            if isinstance(module, MoeMLP) and i in approximation.dense_layers:
                shared, experts, routing = dense_form(module), (), None
            elif isinstance(module, MoeMLP):
                shared, experts, routing = _moe_parts(module, approximation.routings.get(where))
            else:
                mlp = adapter.mlp(i)
                shared, experts, routing = _gated((mlp.gate, mlp.up, mlp.down), "the dense MLP"), (), None
                if mlp.act != SUPPORTED_ACT:
                    raise NotRepresentable(f"the dense MLP uses activation {mlp.act!r}; exportable: {SUPPORTED_ACT!r}")
                if any(b is not None for b in (mlp.up_bias, mlp.gate_bias, mlp.down_bias)):
                    raise NotRepresentable("the dense MLP has biases; standard formats have none")
            if routing is not None and routing.weight.shape[0] != len(experts):
                raise NotRepresentable(f"the router scores {routing.weight.shape[0]} experts, the layer has "
                                       f"{len(experts)}")
        except NotRepresentable as error:
            errors.append(error.at(where))
            continue
        if shared is None:
            shared = GatedMlp.empty(hidden, experts[0].up)
        parts.append(LayerParts(i, where, shared, experts, routing, _input_bound(adapter, i, hidden)))
    return parts, errors


def fold(part: LayerParts, shared_width: int, num_experts: int) -> tuple[GatedMlp, list[GatedMlp], Tensor]:
    """The layer as ``shared_width`` always-on neurons, ``num_experts`` routed experts and their router
    weight (num_experts, d), computing the same function under unit-weight top-1 routing.

    Shared neurons beyond ``shared_width`` join every expert: each token runs exactly one expert with
    weight 1, so it still runs them exactly once (this is how Mixtral, which has no shared part, carries
    MoRE's backbone). A layer with nothing routed puts that overflow in every expert behind a zero
    router. Missing experts repeat expert 0 with its router row: a tie between identical experts gives
    the same output whichever wins. Both need unit-weight top-1 routing, which ``formats.common.routing_reasons``
    requires unless every routed layer has the same number of experts and a shared part that fits."""
    shared = part.shared
    overflow = GatedMlp.empty(shared.up.shape[1], shared.up)
    if shared.width > shared_width:
        overflow = replace(shared, gate=shared.gate[shared_width:], up=shared.up[shared_width:],
                           down=shared.down[:, shared_width:])
        shared = replace(shared, gate=shared.gate[:shared_width], up=shared.up[:shared_width],
                         down=shared.down[:, :shared_width])
    if part.routing is None:
        experts = [overflow] * num_experts
        weight = shared.up.new_zeros(num_experts, shared.up.shape[1])
    else:
        experts = [overflow.cat(e) for e in part.experts]
        weight = part.routing.weight.to(shared.up.dtype)
        missing = num_experts - len(experts)
        experts += [experts[0]] * missing
        weight = torch.cat([weight, weight[:1].expand(missing, -1)])
    return shared.padded(shared_width), experts, weight


def _scatter_rows(narrow: Tensor, groups: int, index: Tensor, head_dim: int) -> Tensor:
    """(groups * head_dim, ...) zeros with ``narrow``'s rows (groups * len(index), ...) at each group's
    kept dimensions ``index``."""
    full = narrow.new_zeros(groups, head_dim, *narrow.shape[1:])
    full[:, index] = narrow.reshape(groups, len(index), *narrow.shape[1:])
    return full.reshape(groups * head_dim, *narrow.shape[1:])


def _scatter_heads(narrow: Tensor, kept: Tensor, heads: int, head_dim: int) -> Tensor:
    """(heads * head_dim, ...) zeros with ``narrow``'s heads (len(kept) * head_dim, ...) at the heads ``kept``."""
    full = narrow.new_zeros(heads, head_dim, *narrow.shape[1:])
    full[kept] = narrow.reshape(len(kept), head_dim, *narrow.shape[1:])
    return full.reshape(heads * head_dim, *narrow.shape[1:])


def _dense_heads(attn: PrunedAttention) -> dict[str, tuple[Tensor, int]] | None:
    """For an attention that kept some of the dense model's heads: per projection, the kept heads among the
    dense ones and the dense count (q and o by query head, k and v by key/value head); None if it kept all."""
    kept = attn.spec().get("kept_kv_heads")
    if kept is None:
        return None
    dense_heads, dense_kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    kv = torch.tensor(kept)
    q = query_heads(kv, dense_heads // dense_kv)
    return {"q_proj": (q, dense_heads), "k_proj": (kv, dense_kv), "v_proj": (kv, dense_kv),
            "o_proj": (q, dense_heads)}


def padded_attention(prefix: str, attn: PrunedAttention, static_dims: Tensor | None = None) -> dict[str, Tensor]:
    """A statically pruned attention's projections at the full head dimension, the pruned dimensions zero:
    zero query/key dimensions add nothing to the scores (RoPE rotates a kept pair into itself; the scaling
    is the dense 1/sqrt(head_dim) already), zero value dimensions add nothing to the output; the same
    function, exactly, in the layout every format reads. Pruned heads come back as zero heads (zero value
    and output: they add nothing). Per-token value/output dimensions (ToMoE's
    router) have no such layout: ``NotRepresentable``, unless ``static_dims`` gives the value/output
    dimensions every token keeps instead (an approximation, ``export.approximate``)."""
    hd, qk = attn.head_dim, attn.qk_index
    if attn.router is not None and static_dims is None:
        raise NotRepresentable("attention keeps value/output head dimensions chosen per token (ToMoE); the formats "
                               "keep the same ones for every token" + APPROXIMATE_HINT + " (static dimensions), or "
                               "convert with attention=off", approximable=True)
    vo = attn.vo_index if attn.router is None else static_dims
    dense = _dense_heads(attn)

    def placed(name: str, rows: Tensor) -> Tensor:  # the kept heads in their places among the dense ones
        return rows if dense is None else _scatter_heads(rows, *dense[name], hd)

    out = {}
    for name, heads, index in (("q_proj", attn.num_heads, qk), ("k_proj", attn.num_kv_heads, qk),
                               ("v_proj", attn.num_kv_heads, vo)):
        linear = getattr(attn, name)
        weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        if name == "v_proj" and attn.router is not None:  # full width: keep the static dimensions' rows
            weight, bias = (None if t is None else t.view(heads, hd, *t.shape[1:])[:, vo].flatten(0, 1)
                            for t in (weight, bias))
        out[f"{prefix}{name}.weight"] = placed(name, _scatter_rows(weight, heads, index, hd))
        if bias is not None:
            out[f"{prefix}{name}.bias"] = placed(name, _scatter_rows(bias, heads, index, hd))
    o_weight = attn.o_proj.weight.detach().T
    if attn.router is not None:
        o_weight = o_weight.view(attn.num_heads, hd, -1)[:, vo].flatten(0, 1)
    out[f"{prefix}o_proj.weight"] = placed("o_proj", _scatter_rows(o_weight, attn.num_heads, vo, hd)).T
    if attn.o_proj.bias is not None:
        out[f"{prefix}o_proj.bias"] = attn.o_proj.bias.detach()
    return out
