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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Dispatch:
    """What every router returns. ``token``/``expert``/``weight`` are (n_pairs,) sorted by expert;
    ``counts`` is (num_experts,) with the number of pairs per expert."""

    token: Tensor
    expert: Tensor
    weight: Tensor
    counts: Tensor

    @staticmethod
    def from_topk(indices: Tensor, weights: Tensor, num_experts: int) -> "Dispatch":
        """indices, weights: (tokens, k) -> flat pairs sorted by expert."""
        tokens, k = indices.shape
        flat_expert = indices.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token = torch.arange(tokens, device=indices.device).repeat_interleave(k)
        return Dispatch(
            token=token[order],
            expert=flat_expert[order],
            weight=weights.reshape(-1)[order],
            counts=torch.bincount(flat_expert, minlength=num_experts),
        )


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
        if name != "top_k":
            raise KeyError(f"router option {name!r} is unknown; options: top_k")
        if not 1 <= int(value) <= self.num_experts:
            raise ValueError(f"top_k={value} must be in [1, {self.num_experts}] (the routed experts)")
        self.top_k = int(value)

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


ROUTERS: dict[str, type[nn.Module]] = {RepresentativeRouter.kind: RepresentativeRouter}


class MoeMLP(nn.Module):
    """Drop-in replacement of a dense MLP: ``shared(x) + sum_e g_e(x) * expert_e(x) + down_bias``.

    ``stats`` accumulates, while ``track_stats`` is on, the tokens seen and the tokens per expert, from
    which moeify measures the activated parameters per token and the expert load.
    """

    def __init__(self, experts: list[ExpertMLP], router: nn.Module, shared: ExpertMLP | None = None,
                 down_bias: Tensor | None = None) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.router = router
        self.shared = shared
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias)
        self.track_stats = False
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats_tokens = 0
        self.stats_expert_tokens = torch.zeros(len(self.experts), dtype=torch.long)

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (tokens, d)
        dispatch = self.router(x)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        counts = dispatch.counts.tolist()
        start = 0
        for e, n in enumerate(counts):  # only the experts that received tokens run, on those tokens
            if n:
                rows = dispatch.token[start:start + n]
                y = self.experts[e](x.index_select(0, rows)) * dispatch.weight[start:start + n, None]
                out = out.index_add(0, rows, y)
                start += n
        if self.down_bias is not None:
            out = out + self.down_bias
        if self.track_stats:
            self.stats_tokens += x.shape[0]
            self.stats_expert_tokens += dispatch.counts.cpu()
        return out.reshape(shape)

    def forward_all_experts(self, hidden_states: Tensor) -> Tensor:
        """Every expert on every token with unit weight: reproduces the dense MLP (identity tests)."""
        out = sum(expert(hidden_states) for expert in self.experts)
        if self.shared is not None:
            out = out + self.shared(hidden_states)
        return out + self.down_bias if self.down_bias is not None else out

    def spec(self) -> dict[str, Any]:
        """Everything needed to rebuild this layer's structure (the weights come from safetensors)."""
        first = self.experts[0].neurons
        return {
            "hidden_size": first.up.in_features,
            "act": first.act_name,
            "gated": first.gated,
            "up_bias": first.up.bias is not None,
            "down_bias": self.down_bias is not None,
            "expert_widths": [e.width for e in self.experts],
            "shared_width": 0 if self.shared is None else self.shared.width,
            "router": self.router.spec(),
        }


def build_moe_mlp(spec: dict[str, Any]) -> MoeMLP:
    """An MoeMLP with the structure of ``spec`` and uninitialised weights (to be loaded)."""
    d, act, gated, up_bias = spec["hidden_size"], spec["act"], spec["gated"], spec["up_bias"]
    experts = [ExpertMLP(d, w, act, gated, up_bias) for w in spec["expert_widths"]]
    shared = ExpertMLP(d, spec["shared_width"], act, gated, up_bias) if spec["shared_width"] else None
    router_spec = dict(spec["router"])
    router_cls = ROUTERS[router_spec.pop("kind")]
    router = router_cls(hidden_size=d, act=act, gated=gated, up_bias=up_bias, **router_spec)
    down_bias = torch.zeros(d) if spec["down_bias"] else None
    return MoeMLP(experts, router, shared, down_bias)


def install_moe_layers(model: nn.Module, layers: dict[str, dict[str, Any]]) -> None:
    """Replace the modules at the given dotted paths by MoE layers built from their specs."""
    for path, spec in layers.items():
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, build_moe_mlp(spec))


def moe_layer_specs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{dotted path: spec} of every MoE layer in ``model`` (what ``install_moe_layers`` rebuilds)."""
    return {name: module.spec() for name, module in model.named_modules() if isinstance(module, MoeMLP)}


def moe_causal_lm_class(base_cls: type, config_cls: type | None = None) -> type:
    """A subclass of a transformers causal-LM class whose constructor installs the MoE layers listed in
    ``config.moeify["layers"]``, so that ``from_pretrained`` loads a converted checkpoint natively."""

    def __init__(self, config) -> None:  # noqa: N807
        base_cls.__init__(self, config)
        install_moe_layers(self, config.moeify["layers"])

    attrs: dict[str, Any] = {"__init__": __init__, "__module__": __name__}
    if config_cls is not None:
        attrs["config_class"] = config_cls
    return type("MoeifyForCausalLM", (base_cls,), attrs)
