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
pay for their padding (MoRE: about a tenth, benchmarks/bench_export_layout.py). The packed copy is rebuilt
whenever a weight changes, and dropped by the next forward with gradients on; it holds the layer's
weights a second time while it exists. A projection wrapped by an adapter (LoRA) keeps the per-expert
path. Experts that overlap (ToMoE's) are stored once (``experts.SharedNeuronExperts``); their packed
copy gathers each expert's rows from the union (``PackedExperts.gathered``), so at inference such a layer
holds its experts' summed widths beside the union, as its export does. Gathering the rows at every forward
instead would hold less but read and write the chosen experts' weights once more per forward: measured
slower on a CPU at every token count tried, from one token to hundreds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .experts import ExpertMLP, HiddenNeurons, SharedNeuronExperts
from .packed import PackedExperts, packed_widths
from .dispatch import Dispatch
from .routers import ROUTERS, Router

FORMAT_VERSION = 1


class MoeMLP(nn.Module):
    """Drop-in replacement of a dense MLP: ``shared(x) + sum_e g_e(x) * expert_e(x) + down_bias``.

    ``stats`` accumulates, while ``track_stats`` is on, the tokens seen and the tokens per expert, from
    which moeify measures the activated parameters per token and the expert load. With no routed
    experts (and no router) the layer is a statically narrowed MLP (a pruning baseline); ``dense_width``
    is the hidden width of the dense MLP it replaces, for parameter accounting.

    ``experts`` is a list of disjoint ``ExpertMLP`` modules, or one ``SharedNeuronExperts`` when the
    experts overlap (ToMoE): then their neurons are stored once, and ``pseudo_moe`` is possible.
    """

    def __init__(self, experts: list[ExpertMLP] | SharedNeuronExperts, router: Router | None,
                 shared: ExpertMLP | None = None, down_bias: Tensor | None = None,
                 dense_width: int | None = None) -> None:
        super().__init__()
        if (router is None) != (not len(experts)) or (shared is None and not len(experts)):
            raise ValueError("an MoeMLP needs routed experts with a router, or a shared part alone")
        self.experts = experts if isinstance(experts, SharedNeuronExperts) else nn.ModuleList(experts)
        self.router = router
        self.shared = shared
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias)
        widths = sum(self.expert_widths) + (0 if shared is None else shared.width)
        self.dense_width = widths if dense_width is None else dense_width
        self.track_stats = False
        self.reset_stats()
        self.pseudo_moe = False
        # (W, S) of ``packed_widths``: this layer's own until ``set_packed_widths`` gives the model's.
        self.packed_widths = packed_widths(self.expert_widths, [] if shared is None else [shared.width])
        self._packed: tuple[tuple, PackedExperts] | None = None

    @property
    def shares_neurons(self) -> bool:
        """Whether the experts overlap and are stored once (``SharedNeuronExperts``)."""
        return isinstance(self.experts, SharedNeuronExperts)

    @property
    def expert_widths(self) -> list[int]:
        return self.experts.widths if self.shares_neurons else [e.width for e in self.experts]

    @property
    def neuron_layout(self) -> HiddenNeurons:
        """A part's input half, for what all parts share: width of x, activation, gating, biases."""
        if self.shared is not None:
            return self.shared.neurons
        return self.experts.neurons if self.shares_neurons else self.experts[0].neurons

    def expert_modules(self) -> list[ExpertMLP]:
        """Every routed expert as its own module (copies, when the experts share neurons)."""
        if self.shares_neurons:
            return [self.experts.expert(e) for e in range(len(self.experts))]
        return list(self.experts)

    def _expert_output(self, e: int, x: Tensor) -> Tensor:
        return self.experts.expert_output(e, x) if self.shares_neurons else self.experts[e](x)

    def drop_inference_copy(self) -> None:
        """Free the packed copy of the experts (rebuilt at the next inference forward)."""
        self._packed = None

    def reset_stats(self) -> None:
        self.stats_tokens = 0
        self.stats_expert_tokens = torch.zeros(len(self.experts), dtype=torch.long)

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (tokens, d)
        packed = None
        if self.router is not None and not self.pseudo_moe and not torch.is_grad_enabled():
            packed = self._current_pack()  # None where a projection is wrapped (LoRA): the per-expert path
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
        """Training path: each routed expert's own modules on exactly its tokens, added to ``out``. The
        dispatch is sorted by expert, so one gather lines up every expert's tokens as contiguous slices and
        one scatter adds the weighted outputs back (per token in expert order, as a loop of adds would)."""
        dispatch = self.router(x).chosen()  # at inference on a GPU (adapters) a threshold router lists every pair
        self._track(dispatch)
        scale = self.router.expert_scale
        weight = dispatch.weight * scale if scale != 1.0 else dispatch.weight
        slices = x.index_select(0, dispatch.token).split(dispatch.counts.tolist())  # (n_e, d) per expert
        outputs = [self._expert_output(e, rows) for e, rows in enumerate(slices) if len(rows)]  # only routed ones
        if not outputs:
            return out
        return out.index_add(0, dispatch.token, torch.cat(outputs) * weight[:, None])

    def _packed_forward(self, x: Tensor, packed: PackedExperts) -> Tensor:
        """Inference path: the packed experts (see the module docstring), summed like transformers' MoE
        blocks: per token over its top-k slots in order, then plus the shared part. A decoding step on a GPU
        (a top-k router's few pairs) runs the whole layer in ``few_pairs``' kernels instead."""
        k = getattr(self.router, "top_k", None)
        if k is not None and not self.track_stats and packed.runs_few_pairs(x, x.shape[0] * k):
            return packed.few_pairs_output(x, *self.router.choose(x))
        dispatch = self.router(x)
        self._track(dispatch)
        shared = packed.shared_output(x) if packed.shared is not None else None
        if dispatch.token.numel() == 0:
            return shared if shared is not None else torch.zeros_like(x)
        y = packed.routed_output(x, dispatch)
        if dispatch.slot is None:  # a token-dependent number of experts: add in dispatch order
            return (shared if shared is not None else torch.zeros_like(x)).index_add(0, dispatch.token, y)
        if dispatch.top_k == 1:  # one pair per token: shared + y exactly, added in place (one operation)
            if shared is None:
                return torch.empty_like(x).index_copy_(0, dispatch.token, y)
            return shared.index_add_(0, dispatch.token, y)
        # pair i holds slot[i]: gathering by the inverse permutation puts them in slot order, as the
        # scatter routed[slot] = y would, in one read of y (a row scatter is the slower copy on a CPU)
        inverse = torch.empty_like(dispatch.slot)
        inverse[dispatch.slot] = torch.arange(len(inverse), device=inverse.device)
        routed = y.index_select(0, inverse)
        if dispatch.top_k > 1:
            routed = routed.view(x.shape[0], dispatch.top_k, -1).sum(dim=1)
        return routed if shared is None else routed + shared

    def _current_pack(self) -> PackedExperts | None:
        """The packed copy of the current weights, rebuilt when a weight was changed in place (its
        version counter moved) or replaced (its storage moved), or the widths changed. None while a
        projection is not a plain ``nn.Linear`` (e.g. wrapped by a LoRA adapter): the packed copy would
        miss what the wrapper adds, so the per-expert path runs."""
        # Runs on every forward (decode included), so it reads nn.Module's own dicts, not __getattr__.
        parts = [self.experts] if self.shares_neurons else list(self.experts._modules.values())
        parts += () if self.shared is None else (self.shared,)
        linears = [m for part in parts for neurons in (part._modules["neurons"]._modules,)
                   for m in (neurons.get("gate"), neurons["up"], part._modules["down"]) if m is not None]
        if any(type(m) is not nn.Linear for m in linears):
            return None
        if torch.compiler.is_compiling():  # a graph cannot compare data pointers: it runs the copy built eagerly
            return self._packed[1] if self._packed is not None else self._pack()
        tensors = [t for m in linears for t in m._parameters.values() if t is not None]
        if self.shares_neurons:
            tensors.append(self.experts._buffers["index"])
        key = (self.packed_widths, self.router.expert_scale, tuple((t.data_ptr(), t._version) for t in tensors))
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # free the stale copy before building the new one
            self._packed = (key, self._pack())
        return self._packed[1]

    def _pack(self) -> PackedExperts:
        """A new packed copy: gathered from the union where the experts share neurons, else stacked."""
        if self.shares_neurons:
            return PackedExperts.gathered(self.experts, self.shared, self.router.expert_scale, self.packed_widths)
        return PackedExperts.from_experts(list(self.experts), self.shared, self.router.expert_scale,
                                          self.packed_widths)

    def _pseudo_moe(self, x: Tensor) -> Tensor:
        """ToMoE's pseudo-MoE (Appendix B.3, Eq. 17): the stored union of the experts' neurons as one dense
        MLP, each token's hidden activations times the 0/1 mask of its routed experts (weighted). Equal
        to the gathered experts, because an expert is the union restricted to its neurons."""
        if not self.shares_neurons:
            raise ValueError("pseudo_moe needs experts that share neurons (ToMoE's); this layer's are disjoint")
        bank = self.experts
        masks = torch.zeros(len(bank), bank.down.in_features, dtype=x.dtype, device=x.device)
        masks.scatter_(1, bank.index.long(), 1.0)
        dispatch = self.router(x)
        self._track(dispatch)
        weights = torch.zeros(x.shape[0], len(bank), dtype=x.dtype, device=x.device)
        weights[dispatch.token, dispatch.expert] = dispatch.weight * self.router.expert_scale
        return bank.down(bank.neurons(x) * (weights @ masks))

    def forward_all_experts(self, hidden_states: Tensor) -> Tensor:
        """Every expert on every token with unit weight: reproduces the dense MLP (identity tests)."""
        out = sum(self._expert_output(e, hidden_states) for e in range(len(self.experts)))
        if self.shared is not None:
            out = out + self.shared(hidden_states)
        return out + self.down_bias if self.down_bias is not None else out

    def spec(self) -> dict[str, Any]:
        """Everything needed to rebuild this layer's structure (the weights come from safetensors)."""
        first = self.neuron_layout
        return {
            "hidden_size": first.up.in_features,
            "act": first.act_name,
            "gated": first.gated,
            "up_bias": first.up.bias is not None,
            "down_bias": self.down_bias is not None,
            "expert_widths": self.expert_widths,
            "shared_width": 0 if self.shared is None else self.shared.width,
            "dense_width": self.dense_width,
            "router": None if self.router is None else self.router.spec(),
            "union_width": self.experts.down.in_features if self.shares_neurons else None,
        }


def build_moe_mlp(spec: dict[str, Any]) -> MoeMLP:
    """An MoeMLP with the structure of ``spec`` and uninitialised weights (to be loaded)."""
    d, act, gated, up_bias = spec["hidden_size"], spec["act"], spec["gated"], spec["up_bias"]
    widths = spec["expert_widths"]
    if spec.get("union_width"):
        experts = SharedNeuronExperts(d, spec["union_width"], len(widths), widths[0], act, gated, up_bias)
    else:
        experts = [ExpertMLP(d, w, act, gated, up_bias) for w in widths]
    shared = ExpertMLP(d, spec["shared_width"], act, gated, up_bias) if spec["shared_width"] else None
    router = None
    if spec["router"] is not None:  # router constructors take the layer's shape keywords they need
        router_spec = dict(spec["router"])
        router_cls = ROUTERS[router_spec.pop("kind")]
        router = router_cls(hidden_size=d, act=act, gated=gated, up_bias=up_bias, **router_spec)
    down_bias = torch.zeros(d) if spec["down_bias"] else None
    return MoeMLP(experts, router, shared, down_bias, dense_width=spec.get("dense_width"))


def install_moe_layers(model: nn.Module, layers: dict[str, dict[str, Any]]) -> None:
    """Replace the modules at the given dotted paths by MoE layers built from their specs."""
    for path, spec in layers.items():
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, build_moe_mlp(spec))


def drop_inference_copies(model: nn.Module) -> None:
    """Free the packed copy of every MoE layer's experts in ``model`` (rebuilt at the next inference
    forward): where the experts are about to change or leave memory, a copy held would be stale bytes."""
    for module in model.modules():
        if isinstance(module, MoeMLP):
            module.drop_inference_copy()


def set_packed_widths(model: nn.Module) -> None:
    """Give every routed MoE layer of ``model`` the model-wide ``packed_widths`` (on load and after a
    conversion), the widths a standard export of the model stores."""
    layers = [m for m in model.modules() if isinstance(m, MoeMLP) and m.router is not None]
    widths = packed_widths([w for layer in layers for w in layer.expert_widths],
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
