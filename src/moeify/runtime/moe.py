"""The MoE MLP layer (``MoeMLP``) and how a converted model is rebuilt from its saved structure.

The runtime (this module, ``experts``, ``routers``, ``packed`` and ``attention``) imports only torch and
transformers, on purpose: moeify copies these files next to every converted model, so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` runs exactly this code, with or
without moeify installed.

Design (after torchtune's MoE): ``MoeMLP(experts=, router=, shared=)`` is built by composition; the
router (see ``routers``) returns a ``Dispatch`` and the layer runs each expert on exactly the tokens
routed to it: real sparse compute, never a mask over a dense product.

Two paths compute the same function. While gradients are on (training), each expert is its own
``nn.Linear`` modules, run one after the other. At inference the layer runs a packed copy of its experts
(``packed.PackedExperts``): zero padding is exact, and what it buys is that the float32 sums run through
the same kernels, in the same order, as in a ``moeify export`` of the model, so the exported model
reproduces the native logits bit for bit. Equal experts run as fast as the per-expert loop; unequal ones
pay for their padding (MoRE: ~8-12 %, benchmarks/bench_export_layout.py). The packed copy is rebuilt
whenever a weight changes, and dropped by the next forward with gradients on; it holds the layer's
weights a second time while it exists. A projection wrapped by an adapter (LoRA) keeps the per-expert
path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .experts import ExpertMLP
from .packed import PackedExperts, packed_widths
from .routers import ROUTERS, Dispatch, Router

FORMAT_VERSION = 1


class MoeMLP(nn.Module):
    """Drop-in replacement of a dense MLP: ``shared(x) + sum_e g_e(x) * expert_e(x) + down_bias``.

    ``stats`` accumulates, while ``track_stats`` is on, the tokens seen and the tokens per expert, from
    which moeify measures the activated parameters per token and the expert load. With no routed
    experts (and no router) the layer is a statically narrowed MLP (a pruning baseline); ``dense_width``
    is the hidden width of the dense MLP it replaces, for parameter accounting.
    """

    def __init__(self, experts: list[ExpertMLP], router: Router | None, shared: ExpertMLP | None = None,
                 down_bias: Tensor | None = None, dense_width: int | None = None,
                 expert_neurons: list[list[int]] | None = None) -> None:
        super().__init__()
        if (router is None) != (not experts) or (shared is None and not experts):
            raise ValueError("an MoeMLP needs routed experts with a router, or a shared part alone")
        self.experts = nn.ModuleList(experts)
        self.router = router
        self.shared = shared
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias)
        widths = sum(e.width for e in experts) + (0 if shared is None else shared.width)
        self.dense_width = widths if dense_width is None else dense_width
        self.track_stats = False
        self.reset_stats()
        # Which dense neurons each expert holds, when experts overlap (ToMoE): enables ``pseudo_moe``.
        self.expert_neurons = expert_neurons
        self.pseudo_moe = False
        # (W, S) of ``packed_widths``: this layer's own until ``set_packed_widths`` gives the model's.
        self.packed_widths = packed_widths([e.width for e in experts], [] if shared is None else [shared.width])
        self._packed: tuple[tuple, PackedExperts] | None = None

    def reset_stats(self) -> None:
        self.stats_tokens = 0
        self.stats_expert_tokens = torch.zeros(len(self.experts), dtype=torch.long)

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (tokens, d)
        packed = None
        if self.router is not None and not self.pseudo_moe and not torch.is_grad_enabled():
            packed = self._current_pack()
        if packed is not None:
            out = self._packed_forward(x, packed)
        else:
            self._packed = None  # per-expert path (training, pseudo-MoE, adapters): the copy goes
            out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
            if self.pseudo_moe:
                out = out + self._pseudo_moe(x)
            elif self.router is not None:
                out = self._per_expert_forward(x, out)
        if self.track_stats:
            self.stats_tokens += x.shape[0]
        if self.down_bias is not None:
            out = out + self.down_bias
        return out.reshape(shape)

    def _track(self, dispatch: Dispatch) -> None:
        if self.track_stats:
            self.stats_expert_tokens += dispatch.counts.cpu()

    def _per_expert_forward(self, x: Tensor, out: Tensor) -> Tensor:
        """Training path: each routed expert's own modules on exactly its tokens, added to ``out``."""
        dispatch = self.router(x)
        self._track(dispatch)
        scale = self.router.expert_scale
        weight = dispatch.weight * scale if scale != 1.0 else dispatch.weight
        start = 0
        for e, n in enumerate(dispatch.counts.tolist()):  # only routed experts run, on their tokens
            if n:
                rows = dispatch.token[start:start + n]
                y = self.experts[e](x.index_select(0, rows)) * weight[start:start + n, None]
                out = out.index_add(0, rows, y)
                start += n
        return out

    def _packed_forward(self, x: Tensor, packed: PackedExperts) -> Tensor:
        """Inference path: the packed experts (see the module docstring), summed like transformers' MoE
        blocks: per token over its top-k slots in order, then plus the shared part."""
        dispatch = self.router(x)
        self._track(dispatch)
        shared = packed.shared_output(x) if packed.shared is not None else None
        if dispatch.token.numel() == 0:
            return shared if shared is not None else torch.zeros_like(x)
        y = packed.routed_output(x, dispatch)
        if dispatch.slot is None:  # a token-dependent number of experts: add in dispatch order
            return (shared if shared is not None else torch.zeros_like(x)).index_add(0, dispatch.token, y)
        routed = torch.empty_like(y)
        routed[dispatch.slot] = y
        if dispatch.top_k > 1:
            routed = routed.view(x.shape[0], dispatch.top_k, -1).sum(dim=1)
        return routed if shared is None else routed + shared

    def _current_pack(self) -> PackedExperts | None:
        """The packed copy of the current weights, rebuilt when a weight was changed in place (its
        version counter moved) or replaced (its storage moved), or the widths changed. None while a
        projection is not a plain ``nn.Linear`` (e.g. wrapped by a LoRA adapter): the packed copy would
        miss what the wrapper adds, so the per-expert path runs."""
        # Runs on every forward (decode included), so it reads nn.Module's own dicts, not __getattr__.
        parts = [*self.experts._modules.values(), *(() if self.shared is None else (self.shared,))]
        linears = [m for part in parts for neurons in (part._modules["neurons"]._modules,)
                   for m in (neurons.get("gate"), neurons["up"], part._modules["down"]) if m is not None]
        if any(type(m) is not nn.Linear for m in linears):
            return None
        widths = self.packed_widths
        key = (widths, self.router.expert_scale,
               tuple((t.data_ptr(), t._version) for m in linears for t in m._parameters.values() if t is not None))
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # free the stale copy before building the new one
            self._packed = (key, PackedExperts(list(self.experts), self.shared, self.router.expert_scale, widths))
        return self._packed[1]

    def _pseudo_moe(self, x: Tensor) -> Tensor:
        """ToMoE's pseudo-MoE (Appendix B.3, Eq. 17): the union of the experts' neurons as one dense MLP,
        each token's hidden activations times the 0/1 mask of its routed experts (weighted). Equal to the
        gathered experts, because an expert is the dense MLP restricted to its neurons."""
        if self.expert_neurons is None:
            raise ValueError("pseudo_moe needs the experts' neuron sets (expert_neurons), which this layer lacks")
        union = sorted({n for neurons in self.expert_neurons for n in neurons})
        column = {n: j for j, n in enumerate(union)}
        owner = {}  # a neuron's weights, from the first expert that holds it (all copies are equal)
        for e, neurons in enumerate(self.expert_neurons):
            for pos, n in enumerate(neurons):
                owner.setdefault(n, (e, pos))
        rows = lambda get: torch.stack([get(self.experts[e])[pos] for e, pos in (owner[n] for n in union)])  # noqa: E731
        first = self.experts[0].neurons
        up = rows(lambda ex: ex.neurons.up.weight)
        up_b = None if first.up.bias is None else rows(lambda ex: ex.neurons.up.bias)
        down = rows(lambda ex: ex.down.weight.t()).t()
        masks = torch.zeros(len(self.experts), len(union), dtype=x.dtype, device=x.device)
        for e, neurons in enumerate(self.expert_neurons):
            masks[e, [column[n] for n in neurons]] = 1.0
        dispatch = self.router(x)
        weights = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype, device=x.device)
        weights[dispatch.token, dispatch.expert] = dispatch.weight
        hidden = nn.functional.linear(x, up, up_b)
        if first.gate is not None:
            gate_b = None if first.gate.bias is None else rows(lambda ex: ex.neurons.gate.bias)
            hidden = first.act(nn.functional.linear(x, rows(lambda ex: ex.neurons.gate.weight), gate_b)) * hidden
        else:
            hidden = first.act(hidden)
        if self.track_stats:
            self.stats_expert_tokens += dispatch.counts.cpu()
        return nn.functional.linear(hidden * (weights @ masks), down)

    def forward_all_experts(self, hidden_states: Tensor) -> Tensor:
        """Every expert on every token with unit weight: reproduces the dense MLP (identity tests)."""
        out = sum(expert(hidden_states) for expert in self.experts)
        if self.shared is not None:
            out = out + self.shared(hidden_states)
        return out + self.down_bias if self.down_bias is not None else out

    def spec(self) -> dict[str, Any]:
        """Everything needed to rebuild this layer's structure (the weights come from safetensors)."""
        first = (self.shared or self.experts[0]).neurons
        return {
            "hidden_size": first.up.in_features,
            "act": first.act_name,
            "gated": first.gated,
            "up_bias": first.up.bias is not None,
            "down_bias": self.down_bias is not None,
            "expert_widths": [e.width for e in self.experts],
            "shared_width": 0 if self.shared is None else self.shared.width,
            "dense_width": self.dense_width,
            "router": None if self.router is None else self.router.spec(),
            "expert_neurons": self.expert_neurons,
        }


def build_moe_mlp(spec: dict[str, Any]) -> MoeMLP:
    """An MoeMLP with the structure of ``spec`` and uninitialised weights (to be loaded)."""
    d, act, gated, up_bias = spec["hidden_size"], spec["act"], spec["gated"], spec["up_bias"]
    experts = [ExpertMLP(d, w, act, gated, up_bias) for w in spec["expert_widths"]]
    shared = ExpertMLP(d, spec["shared_width"], act, gated, up_bias) if spec["shared_width"] else None
    router = None
    if spec["router"] is not None:  # router constructors take the layer's shape keywords they need
        router_spec = dict(spec["router"])
        router_cls = ROUTERS[router_spec.pop("kind")]
        router = router_cls(hidden_size=d, act=act, gated=gated, up_bias=up_bias, **router_spec)
    down_bias = torch.zeros(d) if spec["down_bias"] else None
    return MoeMLP(experts, router, shared, down_bias, dense_width=spec.get("dense_width"),
                  expert_neurons=spec.get("expert_neurons"))


def install_moe_layers(model: nn.Module, layers: dict[str, dict[str, Any]]) -> None:
    """Replace the modules at the given dotted paths by MoE layers built from their specs."""
    for path, spec in layers.items():
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, build_moe_mlp(spec))


def set_packed_widths(model: nn.Module) -> None:
    """Give every routed MoE layer of ``model`` the model-wide ``packed_widths`` (on load and after a
    conversion), the widths a standard export of the model stores."""
    layers = [m for m in model.modules() if isinstance(m, MoeMLP) and m.router is not None]
    widths = packed_widths([e.width for layer in layers for e in layer.experts],
                           [layer.shared.width for layer in layers if layer.shared is not None])
    for layer in layers:
        layer.packed_widths = widths


def moe_layer_specs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{dotted path: spec} of every MoE layer in ``model`` (what ``install_moe_layers`` rebuilds)."""
    return {name: module.spec() for name, module in model.named_modules() if isinstance(module, MoeMLP)}


def moe_causal_lm_class(base_cls: type, config_cls: type | None = None, *installers: Any) -> type:
    """A subclass of a transformers causal-LM class whose constructor installs the MoE layers listed in
    ``config.moeify["layers"]``, so that ``from_pretrained`` loads a converted checkpoint natively.
    Each of ``installers`` (e.g. the pruned attention's) is called with the model and the moeify block."""

    def __init__(self, config) -> None:  # noqa: N807
        base_cls.__init__(self, config)
        install_moe_layers(self, config.moeify["layers"])
        set_packed_widths(self)
        for install in installers:
            install(self, config.moeify)

    attrs: dict[str, Any] = {"__init__": __init__, "__module__": __name__}
    if config_cls is not None:
        attrs["config_class"] = config_cls
    return type("MoeifyForCausalLM", (base_cls,), attrs)
