"""The MoE MLP layer and its routers, as run at inference.

This module is self-contained on purpose (it imports only torch and transformers): moeify copies it
next to every converted model, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``
runs exactly this code, with or without moeify installed.

Design (after torchtune's MoE): ``MoeMLP(experts=, router=, shared=)`` is built by composition. A router
is an ``nn.Module`` with ``kind`` (its key in ``ROUTERS``), ``num_experts``, ``forward(x) -> Dispatch``,
``expected_experts()`` (routed experts per token under its nominal assumption), ``set_option(name,
value)`` for runtime options and ``spec()`` (constructor arguments, rebuilt by ``build_moe_mlp``). It
returns a ``Dispatch``: a flat list of (token, expert, weight) triples sorted by expert, plus per-expert
counts from ``torch.bincount`` (which, unlike ``histc``, works for integers on CPU). The layer then runs
each expert on exactly the tokens routed to it: real sparse compute, never a mask over a dense product.

Two paths compute the same function. While gradients are on (training), each expert is its own
``nn.Linear`` modules, run one after the other. At inference the layer runs a packed copy of its experts
(``PackedExperts``), laid out the way transformers 5 and serving engines hold MoE experts: gate and up
rows of all experts stacked in one (E, 2W, d) tensor, zero-padded to one aligned width W, one grouped
matmul per projection over the tokens sorted by expert, the shared part zero-padded to an aligned S.
Zero padding is exact; what it buys is that the float32 sums run through the same kernels, in the same
order, as in a ``moeify export`` of the model, so the exported model reproduces the native logits
bit for bit. Equal experts run as fast as the per-expert loop; unequal ones pay for their padding
(MoRE: ~8-12 %, benchmarks/bench_export_layout.py). The packed copy is rebuilt whenever a weight
changes, and dropped by the next forward with gradients on; it holds the layer's weights a second time
while it exists. A projection wrapped by an adapter (LoRA) keeps the per-expert path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Dispatch:
    """What every router returns. ``token``/``expert``/``weight`` are (n_pairs,) sorted by expert;
    ``counts`` is (num_experts,) with the number of pairs per expert. A top-k router's dispatch also
    has ``top_k`` and ``slot``: each pair's index in the flattened (tokens, k) choice matrix, so that
    the expert outputs can be summed per token in slot order, as transformers does."""

    token: Tensor
    expert: Tensor
    weight: Tensor
    counts: Tensor
    top_k: int | None = None
    slot: Tensor | None = None

    @staticmethod
    def from_topk(indices: Tensor, weights: Tensor, num_experts: int) -> "Dispatch":
        """indices, weights: (tokens, k) -> flat pairs sorted by expert with ``torch.sort``, the sort of
        transformers' MoE experts (which order tokens within an expert's group changes float32 sums)."""
        k = indices.shape[1]
        flat_expert = indices.reshape(-1)
        expert, slot = torch.sort(flat_expert)
        return Dispatch(token=slot // k, expert=expert, weight=weights.reshape(-1)[slot],
                        counts=torch.bincount(flat_expert, minlength=num_experts), top_k=k, slot=slot)

    @staticmethod
    def from_mask(active: Tensor, weights: Tensor) -> "Dispatch":
        """active: (tokens, experts) bool, any number of experts per token (none included); weights:
        (tokens, experts), read where active -> flat pairs sorted by expert (then token)."""
        expert, token = active.T.nonzero(as_tuple=True)  # row-major order of (expert, token): sorted by expert
        return Dispatch(token=token, expert=expert, weight=weights[token, expert],
                        counts=torch.bincount(expert, minlength=active.shape[1]))


def set_top_k(router: nn.Module, name: str, value: Any) -> None:
    """The runtime option of every top-k router: ``top_k`` in [1, num_experts]."""
    if name != "top_k":
        raise KeyError(f"router option {name!r} is unknown; options: top_k")
    if not 1 <= int(value) <= router.num_experts:
        raise ValueError(f"top_k={value} must be in [1, {router.num_experts}] (the routed experts)")
    router.top_k = int(value)


class HiddenNeurons(nn.Module):
    """The input half of a set of MLP neurons: ``h = act(x Wg + bg) * (x Wu + bu)`` (gated) or
    ``act(x Wu + bu)`` (two-layer). Experts add a down projection; CMoE's router uses it alone.
    Projections are ``nn.Linear`` so that adapters such as LoRA (peft) can wrap them."""

    def __init__(self, hidden_size: int, width: int, act: str, gated: bool, up_bias: bool) -> None:
        super().__init__()
        self.act_name = act
        self.act = ACT2FN[act]
        self.up = nn.Linear(hidden_size, width, bias=up_bias)
        self.gate = nn.Linear(hidden_size, width, bias=up_bias) if gated else None

    @property
    def width(self) -> int:
        return self.up.out_features

    @property
    def gated(self) -> bool:
        return self.gate is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is None:
            return self.act(self.up(x))
        return self.act(self.gate(x)) * self.up(x)


class ExpertMLP(nn.Module):
    """One expert (or the always-on shared part): a slice of the dense MLP's neurons."""

    def __init__(self, hidden_size: int, width: int, act: str, gated: bool, up_bias: bool) -> None:
        super().__init__()
        self.neurons = HiddenNeurons(hidden_size, width, act, gated, up_bias)
        self.down = nn.Linear(width, hidden_size, bias=False)

    @property
    def width(self) -> int:
        return self.neurons.width

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.neurons(x))


class RepresentativeRouter(nn.Module):
    """CMoE's training-free router (Eq. 24-26) with its differentiable scores and load-balancing bias.

    s = act(x W_gate^R) * (x W_up^R): the hidden states of each routed expert's representative neuron.
    s' = softmax(s) (Eq. 29); experts chosen by TopK(s' + b) (Eq. 32); weight g = 1 + s' * u (Eq. 28).
    ``u`` starts at zero (so g = 1, the un-scaled Eq. 17) and is learnable; ``b`` is a buffer moved by
    ``update_bias`` after each training step (aux-loss-free balancing, Eq. 33).
    """

    kind = "representative"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, act: str, gated: bool, up_bias: bool,
                 bias_speed: float = 0.001) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.bias_speed = num_experts, top_k, bias_speed
        self.neurons = HiddenNeurons(hidden_size, num_experts, act, gated, up_bias)  # one per expert
        self.u = nn.Parameter(torch.zeros(num_experts))
        self.register_buffer("bias", torch.zeros(num_experts))

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_experts": self.num_experts, "top_k": self.top_k,
                "bias_speed": self.bias_speed}

    def expected_experts(self) -> float:
        """Routed experts per token under the router's nominal (uniform-routing) assumption."""
        return float(self.top_k)

    def set_option(self, name: str, value: Any) -> None:
        set_top_k(self, name, value)

    def forward(self, x: Tensor) -> Dispatch:
        scores = torch.softmax(self.neurons(x).float(), dim=-1)  # s' (tokens, experts); Eq. 29
        chosen = torch.topk(scores + self.bias, self.top_k, dim=-1).indices  # Eq. 32
        weight = 1.0 + scores.gather(-1, chosen) * self.u[chosen]  # g_i = 1 + s'_i u_i; Eq. 28
        return Dispatch.from_topk(chosen, weight.to(x.dtype), self.num_experts)

    @torch.no_grad()
    def update_bias(self, counts: Tensor) -> None:
        """Eq. 33: lower the bias of overloaded experts by gamma, raise it for underloaded ones."""
        load = counts.to(self.bias.device).float()
        self.bias -= self.bias_speed * torch.sign(load - load.mean())


class PrototypeRouter(nn.Module):
    """MoRE's training-free router (Eq. 12-13): cosine similarity of the token to each expert's
    prototype mu_i (the mean input of the calibration tokens assigned to it); the ``top_k`` most similar
    experts run with unit weight (MoRE itself uses top-1)."""

    kind = "prototype"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.eps = num_experts, top_k, eps
        self.register_buffer("prototypes", torch.zeros(num_experts, hidden_size))

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_experts": self.num_experts, "top_k": self.top_k, "eps": self.eps}

    def expected_experts(self) -> float:
        return float(self.top_k)

    def set_option(self, name: str, value: Any) -> None:
        set_top_k(self, name, value)

    def similarity(self, x: Tensor) -> Tensor:
        """sim(x, mu_i) = x.mu_i / (|x| |mu_i| + eps): (tokens, experts); Eq. 13. Always in float32, also
        in a float64 copy of the model (the routing decisions are the model's, whatever its precision)."""
        x, protos = x.float(), self.prototypes.float()
        return (x @ protos.T) / (x.norm(dim=-1, keepdim=True) * protos.norm(dim=-1) + self.eps)

    def forward(self, x: Tensor) -> Dispatch:
        chosen = torch.topk(self.similarity(x), self.top_k, dim=-1).indices  # Eq. 12
        return Dispatch.from_topk(chosen, torch.ones(chosen.shape, dtype=x.dtype, device=x.device), self.num_experts)


ROUTERS: dict[str, type[nn.Module]] = {RepresentativeRouter.kind: RepresentativeRouter,
                                       PrototypeRouter.kind: PrototypeRouter}


def aligned_width(width: int) -> int:
    """A width rounded up to a multiple of 8 (rows of 16 bytes in 2-byte dtypes: what grouped_mm needs),
    or of 64 where that is cheap, adding at most 1/16 of the width (the padding is computed, here and
    in an export: 352 stays 352 rather than 384; 1376 becomes 1408)."""
    by64 = -(-width // 64) * 64
    return by64 if by64 - width <= width / 16 else -(-max(width, 1) // 8) * 8


def packed_widths(expert_widths: list[int], shared_widths: list[int]) -> tuple[int, int]:
    """(W, S) for all routed layers of one model: every routed expert is zero-padded to W, the shared
    part to S (0: no shared part). The standard exports are sized by the same two numbers, so native
    and exported layers compute alike."""
    return aligned_width(max(expert_widths, default=1)), \
        aligned_width(max(shared_widths)) if max(shared_widths, default=0) else 0


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``x`` (rows sorted by expert; expert e's rows end at ``offsets[e]``) times ``weight[e].T``
    (weight: (experts, out, in)) -> (rows, out): torch's grouped_mm, as transformers' experts run it,
    or one matmul per expert where grouped_mm has no kernel (float64; older torch or GPUs)."""
    grouped = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is not None and x.dtype in GROUPED_MM_DTYPES:
        try:
            return grouped(x, weight.transpose(-2, -1), offs=offsets)
        except (RuntimeError, NotImplementedError):  # e.g. a GPU without a grouped_mm kernel
            pass
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[e].T, out=out[start:end])
        start = end
    return out


def _padded_rows(weight: Tensor, width: int) -> Tensor:
    return F.pad(weight, (0, 0, 0, width - weight.shape[0])) if weight.dim() == 2 else \
        F.pad(weight, (0, width - weight.shape[0]))


class PackedExperts:
    """A layer's MLP weights for inference, laid out as transformers 5 holds MoE experts (see the module
    docstring): ``first`` (E, 2W, d), each expert's gate rows then its up rows (two-layer MLPs: (E, W, d),
    up rows), ``first_bias`` likewise or None, ``down`` (E, d, W) times the router's ``expert_scale``,
    all zero-padded to W; ``shared``: the shared part's (gate, up, gate bias, up bias, down) zero-padded
    to S (gate and biases may be None), or None."""

    def __init__(self, layer: "MoeMLP", widths: tuple[int, int]) -> None:
        width, shared_width = widths
        neurons = [e.neurons for e in layer.experts]
        first = neurons[0]
        self.act, self.gated = first.act, first.gated

        def stacked_first(part: str) -> Tensor:  # part: "weight" or "bias"
            rows = [[getattr(n.gate, part), getattr(n.up, part)] if n.gated else [getattr(n.up, part)]
                    for n in neurons]
            return torch.stack([torch.cat([_padded_rows(t, width) for t in pair]) for pair in rows])

        with torch.no_grad():
            self.first = stacked_first("weight")
            self.first_bias = None if first.up.bias is None else stacked_first("bias")
            scale = float(getattr(layer.router, "expert_scale", 1.0))
            downs = [e.down.weight * scale if scale != 1.0 else e.down.weight for e in layer.experts]
            self.down = torch.stack([F.pad(d, (0, width - d.shape[1])) for d in downs])
            self.shared = None
            if layer.shared is not None:
                n, pad = layer.shared.neurons, lambda t: None if t is None else _padded_rows(t, shared_width)
                self.shared = (None if n.gate is None else pad(n.gate.weight), pad(n.up.weight),
                               None if n.gate is None else pad(n.gate.bias), pad(n.up.bias),
                               F.pad(layer.shared.down.weight, (0, shared_width - layer.shared.width)))

    def shared_output(self, x: Tensor) -> Tensor:
        gate, up, gate_bias, up_bias, down = self.shared
        h = F.linear(x, up, up_bias)
        h = self.act(F.linear(x, gate, gate_bias)) * h if gate is not None else self.act(h)
        return F.linear(h, down)

    def routed_output(self, x: Tensor, dispatch: Dispatch) -> Tensor:
        """Every (token, expert) pair's weighted expert output, (pairs, d), in the dispatch's order."""
        offsets = torch.cumsum(dispatch.counts, 0, dtype=torch.int32)
        h = grouped_linear(x[dispatch.token], self.first, offsets)
        if self.first_bias is not None:
            h = h + self.first_bias[dispatch.expert]
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return grouped_linear(h, self.down, offsets) * dispatch.weight[:, None]


class MoeMLP(nn.Module):
    """Drop-in replacement of a dense MLP: ``shared(x) + sum_e g_e(x) * expert_e(x) + down_bias``.

    ``stats`` accumulates, while ``track_stats`` is on, the tokens seen and the tokens per expert, from
    which moeify measures the activated parameters per token and the expert load. With no routed
    experts (and no router) the layer is a statically narrowed MLP (a pruning baseline); ``dense_width``
    is the hidden width of the dense MLP it replaces, for parameter accounting.
    """

    def __init__(self, experts: list[ExpertMLP], router: nn.Module | None, shared: ExpertMLP | None = None,
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
        scale = getattr(self.router, "expert_scale", 1.0)
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
        key = (widths, getattr(self.router, "expert_scale", 1.0),
               tuple((t.data_ptr(), t._version) for m in linears for t in m._parameters.values() if t is not None))
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # free the stale copy before building the new one
            self._packed = (key, PackedExperts(self, widths))
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


SIGMOID_AT_ZERO = 0.5  # sigma(0): the gate value of an untrained DSMoE gate (Y = 0)


def passing_gates(gates: Tensor, tau: float) -> Tensor:
    """DSMoE's condition of G (Eq. 7), g_i >= tau: (tokens, experts) bool. The paper writes g > tau; the
    two differ only where g equals tau exactly, which in practice happens only for untrained gates
    (Y = 0, g = 1/2) at tau = 1/2: counting that tie as passing makes the untrained model at the default
    tau the dense model, so training starts from it."""
    return gates >= tau


def rescaled_gate_weights(values: Tensor, active: Tensor) -> Tensor:
    """DSMoE's expert weights (tokens, experts) from gate values already thresholded (G(g) of Eq. 7, or
    its straight-through form S(g) of Eq. 10 while training): ``values / sigma(0) * n / |A|``.

    n / |A| is Eq. 8's rescale by the number of active experts (|A| = 0 is taken as 1: a token whose
    gates all stay below tau gets no expert, so its output is zero). Dividing the gate value by
    sigma(0) = 1/2 makes an untrained gate (Y = 0) neutral, so that with every expert on the layer is
    the dense MLP (Eq. 7 alone would halve it)."""
    rescale = active.shape[-1] / active.sum(dim=-1, keepdim=True).clamp_min(1)  # n / |A|; Eq. 8
    return values * (rescale / SIGMOID_AT_ZERO)


class ThresholdRouter(nn.Module):
    """DSMoE's router (Lv et al., 2025, Eq. 7-8): sigmoid gates g = sigma(x Y), Y in R^{d x n} (stored as
    ``proj.weight``, (n, d)); expert i runs for a token when g_i >= tau, so the number of experts per token
    varies (none included), weighted by ``rescaled_gate_weights``. ``tau`` is a runtime option; the
    expert count per token depends on the data, so there is no nominal count (``expected_experts`` is
    None) and the activated ratio is always measured."""

    kind = "threshold"

    def __init__(self, hidden_size: int, num_experts: int, tau: float = 0.5, **_: Any) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tau = check_tau(tau)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        nn.init.zeros_(self.proj.weight)  # untrained gates: g = 1/2 for every token and expert

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_experts": self.num_experts, "tau": self.tau}

    def expected_experts(self) -> None:
        """No nominal count: how many gates pass tau depends on the tokens."""
        return None

    def set_option(self, name: str, value: Any) -> None:
        if name != "tau":
            raise KeyError(f"router option {name!r} is unknown; options: tau")
        self.tau = check_tau(value)

    def gates(self, x: Tensor) -> Tensor:
        """g = sigma(x Y): (tokens, experts), in float32; Eq. 7."""
        return torch.sigmoid(self.proj(x).float())

    def forward(self, x: Tensor) -> Dispatch:
        gates = self.gates(x)
        active = passing_gates(gates, self.tau)  # the condition of G; Eq. 7
        weights = rescaled_gate_weights(torch.where(active, gates, 0.0), active)  # Eq. 7-8
        return Dispatch.from_mask(active, weights.to(x.dtype))


def check_tau(value: Any) -> float:
    """The threshold tau of a sigmoid gate, in [0, 1]."""
    try:
        tau = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"tau={value!r} is not a number") from None
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau={tau} is out of range; allowed: [0, 1] (a sigmoid gate value)")
    return tau


ROUTERS[ThresholdRouter.kind] = ThresholdRouter


class LinearTopKRouter(nn.Module):
    """Shared part of the routers that score experts with one linear map x W^T (``proj``, no bias) and
    run the ``top_k`` best; subclasses say how the chosen experts are weighted."""

    kind = ""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, **_: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_experts": self.num_experts, "top_k": self.top_k}

    def expected_experts(self) -> float:
        return float(self.top_k)

    def set_option(self, name: str, value: Any) -> None:
        set_top_k(self, name, value)


class SoftmaxTopKRouter(LinearTopKRouter):
    """Dense2MoE's router (§2.1): p = softmax(x W_g), W_g in R^{d x E} (``proj.weight``, (E, d)); the
    ``top_k`` most probable experts run, each weighted by p_i * E / k (the layer applies ``expert_scale``
    E / k to the experts' outputs, the dispatch carries p_i). The paper's gate is p_i; the
    constant E / k makes the weights of an untrained router (W_g ~ 0, p uniform) sum to 1, so the layer
    starts at the scale of one dense MLP (identical copies then reproduce it exactly, as in sparse
    upcycling) instead of at 1/E of it under top-1. A constant factor can be read as part of the
    experts' down projections, so the model class is the paper's. p stays differentiable, so the
    router learns even at top-1."""

    kind = "softmax_topk"

    @property
    def expert_scale(self) -> float:
        """E / k, applied by the layer to the experts' outputs (the dispatch weights are p_i alone)."""
        return self.num_experts / self.top_k

    def forward(self, x: Tensor) -> Dispatch:
        probs = torch.softmax(self.proj(x).float(), dim=-1)  # p: (tokens, experts)
        weight, chosen = torch.topk(probs, self.top_k, dim=-1)  # (tokens, k)
        return Dispatch.from_topk(chosen, weight.to(x.dtype), self.num_experts)


ROUTERS[SoftmaxTopKRouter.kind] = SoftmaxTopKRouter


class ArgmaxRouter(LinearTopKRouter):
    """ToMoE's MLP router after conversion (Eq. 13): logits x W^T (``proj``, no bias), the ``top_k``
    highest experts (top-1 in the paper) each with weight 1: G is one-hot and the expert output is not
    scaled."""

    kind = "argmax"
    weighting = "unit"  # for exporters: a linear score x W^T, every chosen expert weighs 1

    def linear_score_weight(self) -> Tensor:
        return self.proj.weight

    def forward(self, x: Tensor) -> Dispatch:
        chosen = self.proj(x).topk(self.top_k, dim=-1).indices
        return Dispatch.from_topk(chosen, torch.ones(chosen.shape, dtype=x.dtype, device=x.device), self.num_experts)


ROUTERS[ArgmaxRouter.kind] = ArgmaxRouter
