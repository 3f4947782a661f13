"""Routers: what decides, per token, which experts of an MoE layer run and with what weight. Part of the
runtime copied into every converted folder (imports torch only).

Every router follows the ``Router`` protocol (no shared base class): ``kind`` (its key in ``ROUTERS``),
``num_experts``, ``expert_scale`` (a constant the layer applies to every expert output), ``forward(x) ->
Dispatch``, ``expected_experts()`` (routed experts per token under its nominal assumption, or None),
``set_option(name, value)`` for runtime options, ``spec()`` (constructor arguments, rebuilt by
``moe.build_moe_mlp``) and ``linear_form()``: the router as a linear top-k router ``x @ W.T`` that a
standard MoE format computes, or ``NotLinear`` saying why it is not one. A router whose expert count
varies per token may offer ``fixed_k_form(k)``, its closest linear top-k router (export's approximation).
What a router returns is a ``Dispatch`` (``dispatch.py``). A top-k router's choice comes from its
``choose(x)``: the (tokens, k) expert ids and weights, which ``forward`` sorts into a dispatch and a
decoding step on a GPU hands to ``few_pairs``' kernels as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from .dispatch import Dispatch
from .experts import HiddenNeurons
from .few_pairs import applies as kernels_apply, representative_choice


@dataclass(frozen=True)
class LinearForm:
    """A router as standard MoE formats compute it: scores ``x @ weight.T`` (weight: (experts, d), float64),
    the ``top_k`` best experts, each weighing 1 (``"unit"``), its softmax probability (``"softmax"``) or
    the sigmoid of its score (``"sigmoid"``), times ``expert_scale`` when the form sets it (else the
    router's own)."""

    weight: Tensor
    top_k: int
    weighting: Literal["unit", "softmax", "sigmoid"]
    expert_scale: float | None = None


class NotLinear(ValueError):
    """A router that no linear top-k router reproduces; ``approximable`` when a linear top-k router close to
    it exists (fitted to its decisions, or its own scores at a fixed k: ``moeify export --approximate``)."""

    def __init__(self, reason: str, approximable: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.approximable = reason, approximable


class Router(Protocol):
    kind: str
    num_experts: int
    expert_scale: float

    def __call__(self, x: Tensor) -> Dispatch: ...

    def spec(self) -> dict[str, Any]: ...

    def expected_experts(self) -> float | None: ...

    def set_option(self, name: str, value: Any) -> None: ...

    def linear_form(self) -> LinearForm: ...


def top_k_spec(router: Router, **extra: Any) -> dict[str, Any]:
    """``spec()`` of a top-k router: its kind, expert count, k and its own extra arguments."""
    return {"kind": router.kind, "num_experts": router.num_experts, "top_k": router.top_k, **extra}


def top_k_experts(router: Router) -> float:
    """``expected_experts()`` of a top-k router: k routed experts for every token."""
    return float(router.top_k)


def top_k_dispatch(router: Router, x: Tensor) -> Dispatch:
    """``forward`` of a top-k router: its ``choose(x)`` as a dispatch sorted by expert."""
    return Dispatch.from_topk(*router.choose(x), router.num_experts)


def set_top_k(router: Router, name: str, value: Any) -> None:
    """The runtime option of every top-k router: ``top_k`` in [1, num_experts]."""
    if name != "top_k":
        raise ValueError(f"router option {name!r} is unknown; options: top_k")
    if not 1 <= int(value) <= router.num_experts:
        raise ValueError(f"top_k={value} must be in [1, {router.num_experts}] (the routed experts)")
    router.top_k = int(value)


class RepresentativeRouter(nn.Module):
    """CMoE's training-free router (Eq. 24-26) with its differentiable scores and load-balancing bias.

    s = |act(x W_gate^R) * (x W_up^R)|: the hidden states of each routed expert's representative neuron, as
    magnitudes (``score="abs"``: Eq. 20-26 rank experts by their expected |h|) or signed (``"signed"``).
    s' = softmax(s) (Eq. 29); experts chosen by TopK(s' + b) (Eq. 32); weight g = 1 + s' * u (Eq. 28).
    ``u`` starts at zero (so g = 1, the un-scaled Eq. 17) and is learnable; ``b`` is a buffer moved by
    ``update_bias`` after each training step (aux-loss-free balancing, Eq. 33).
    """

    kind = "representative"
    expert_scale = 1.0

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, act: str, gated: bool, up_bias: bool,
                 bias_speed: float = 0.001, score: Literal["abs", "signed"] = "abs") -> None:
        super().__init__()
        if score not in ("abs", "signed"):
            raise ValueError(f"score={score!r} must be 'abs' or 'signed'")
        self.num_experts, self.top_k, self.bias_speed, self.score = num_experts, top_k, bias_speed, score
        self.neurons = HiddenNeurons(hidden_size, num_experts, act, gated, up_bias)  # one per expert
        self.u = nn.Parameter(torch.zeros(num_experts))
        self.register_buffer("bias", torch.zeros(num_experts))

    expected_experts = top_k_experts
    set_option = set_top_k

    def spec(self) -> dict[str, Any]:
        return top_k_spec(self, bias_speed=self.bias_speed, score=self.score)

    def scores(self, x: Tensor) -> Tensor:
        """s (tokens, experts): the representative neurons' hidden values, |h_R| or signed, in float32."""
        h = self.neurons.forward_float32(x)
        return h.abs() if self.score == "abs" else h

    def linear_form(self) -> LinearForm:
        raise NotLinear("is not linear in x (its scores are the SwiGLU hidden values of representative neurons), "
                        "and standard formats only compute linear scores x @ W.T", approximable=True)

    forward = top_k_dispatch

    def choose(self, x: Tensor) -> tuple[Tensor, Tensor]:
        n = self.neurons
        if (not torch.is_grad_enabled() and type(n.up) is nn.Linear and type(n.gate) is nn.Linear
                and kernels_apply(x, x.shape[0] * self.top_k, self.num_experts, n.act_name, n.gated,
                                  n.up.bias is not None)):  # a decoding step on a GPU: one kernel
            return representative_choice(x, n.gate.weight, n.up.weight, self.bias, self.u, self.top_k,
                                         n.act_name, signed=self.score == "signed")
        scores = torch.softmax(self.scores(x), dim=-1)  # s' (tokens, experts); Eq. 29
        chosen = torch.topk(scores + self.bias, self.top_k, dim=-1).indices  # Eq. 32
        weight = (scores * self.u).gather(-1, chosen).add_(1.0)  # g_i = 1 + s'_i u_i; Eq. 28
        return chosen, weight.to(x.dtype)

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
    expert_scale = 1.0

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.eps = num_experts, top_k, eps
        self.register_buffer("prototypes", torch.zeros(num_experts, hidden_size))

    expected_experts = top_k_experts
    set_option = set_top_k

    def spec(self) -> dict[str, Any]:
        return top_k_spec(self, eps=self.eps)

    def linear_form(self) -> LinearForm:
        """The unit-length prototypes. The top-1 choice maximises ``x.mu_i / (|x| |mu_i| + eps)``; without eps
        that is ``argmax_i x.(mu_i / |mu_i|)``, because |x| is the same for every expert. eps (1e-6) scales
        cosine i by 1 - eps / (|x| |mu_i|), so it can only swap two experts whose cosines differ by less
        than about that (1e-7 for |x| |mu_i| = 10): the float32 rounding of the cosine itself. So the
        unit-length prototypes are an exact linear router up to rounding. A zero prototype stays zero
        (similarity 0)."""
        protos = self.prototypes.detach().double()
        norms = protos.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(protos.dtype).tiny)
        return LinearForm(protos / norms, self.top_k, "unit")

    def similarity(self, x: Tensor) -> Tensor:
        """sim(x, mu_i) = x.mu_i / (|x| |mu_i| + eps): (tokens, experts); Eq. 13. Always in float32, also
        in a float64 copy of the model (the routing decisions are the model's, whatever its precision)."""
        x, protos = x.float(), self.prototypes.float()
        return (x @ protos.T) / (x.norm(dim=-1, keepdim=True) * protos.norm(dim=-1) + self.eps)

    forward = top_k_dispatch

    def choose(self, x: Tensor) -> tuple[Tensor, Tensor]:
        chosen = torch.topk(self.similarity(x), self.top_k, dim=-1).indices  # Eq. 12
        return chosen, torch.ones(chosen.shape, dtype=x.dtype, device=x.device)


SIGMOID_AT_ZERO = 0.5  # sigma(0): the gate value of an untrained DSMoE gate (Y = 0)


def passing_gates(gates: Tensor, tau: float) -> Tensor:
    """DSMoE's condition of G (Eq. 7), g_i >= tau: (tokens, experts) bool. The paper writes g > tau; the
    two differ only where g equals tau exactly, which in practice happens only for untrained gates
    (Y = 0, g = 1/2) at tau = 1/2: counting that tie as passing makes the untrained model at the default
    tau the dense model."""
    return gates >= tau


NEUTRAL_GATE_SCALE = 1 / SIGMOID_AT_ZERO  # an untrained gate (g = 1/2) weighs 1


def rescaled_gate_weights(values: Tensor, active: Tensor, gate_scale: float = NEUTRAL_GATE_SCALE) -> Tensor:
    """DSMoE's expert weights (tokens, experts) from gate values already thresholded (G(g) of Eq. 7, or
    its straight-through form S(g) of Eq. 10 while training): ``values * gate_scale * n / |A|``.

    n / |A| is Eq. 8's rescale by the number of active experts (|A| = 0 is taken as 1: a token whose
    gates all stay below tau gets no expert, so its output is zero). ``gate_scale = 1`` is Eq. 7-8
    exactly; the default 1 / sigma(0) = 2 makes an untrained gate (Y = 0) neutral, so that with every
    expert on the layer is the dense MLP (Eq. 7 alone would halve it); DSMoE's training sets 1 / g0 for
    gates that start at g0."""
    rescale = active.shape[-1] / active.sum(dim=-1, keepdim=True).clamp_min(1)  # n / |A|; Eq. 8
    return values * (rescale * gate_scale)


class ThresholdRouter(nn.Module):
    """DSMoE's router (Lv et al., 2025, Eq. 7-8): sigmoid gates g = sigma(x Y), Y in R^{d x n} (stored as
    ``proj.weight``, (n, d)); expert i runs for a token when g_i >= tau, so the number of experts per token
    varies (none included), weighted by ``rescaled_gate_weights`` with ``gate_scale`` (1: Eq. 7-8 exactly;
    2: an untrained gate is neutral; 1 / g0: a gate at its start value g0 is). ``tau`` is a runtime option; the
    expert count per token depends on the data, so there is no nominal count (``expected_experts`` is
    None) and the activated ratio is always measured."""

    kind = "threshold"
    expert_scale = 1.0

    def __init__(self, hidden_size: int, num_experts: int, tau: float = 0.5,
                 gate_scale: float = NEUTRAL_GATE_SCALE, **_: Any) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tau = check_tau(tau)
        self.gate_scale = gate_scale
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        nn.init.zeros_(self.proj.weight)  # untrained gates: g = 1/2 for every token and expert

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_experts": self.num_experts, "tau": self.tau, "gate_scale": self.gate_scale}

    def expected_experts(self) -> None:
        """No nominal count: how many gates pass tau depends on the tokens."""
        return None

    def set_option(self, name: str, value: Any) -> None:
        if name != "tau":
            raise ValueError(f"router option {name!r} is unknown; options: tau")
        self.tau = check_tau(value)

    def linear_form(self) -> LinearForm:
        raise NotLinear("chooses a token-dependent set of experts (the gates above tau) that no linear top-k router "
                        "of a standard format reproduces", approximable=True)

    def fixed_k_form(self, k: int) -> LinearForm:
        """The closest linear top-k router at a fixed k (export's approximation): the top-k gates are the
        top-k scores x Y, each weighing g_i gate_scale n / k (Eq. 7-8 with |A| = k)."""
        return LinearForm(self.proj.weight.detach().double(), k, "sigmoid",
                          expert_scale=self.gate_scale * self.num_experts / k)

    def gates(self, x: Tensor) -> Tensor:
        """g = sigma(x Y): (tokens, experts), in float32; Eq. 7."""
        return torch.sigmoid(self.proj(x).float())

    def forward(self, x: Tensor) -> Dispatch:
        gates = self.gates(x)
        active = passing_gates(gates, self.tau)  # the condition of G; Eq. 7
        weights = rescaled_gate_weights(torch.where(active, gates, 0.0), active, self.gate_scale)  # Eq. 7-8
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


class SoftmaxTopKRouter(nn.Module):
    """Dense2MoE's router (§2.1): p = softmax(x W_g), W_g in R^{d x E} (``proj.weight``, (E, d)); the
    ``top_k`` most probable experts run, each weighted by p_i times the layer's ``expert_scale``. The
    paper's gate is p_i (``scale=1``). The default scale E / k (of the top_k the layer was built with)
    makes the weights of an untrained router (W_g ~ 0, p uniform) sum to 1, so the layer starts at the
    scale of one dense MLP (identical copies then reproduce it exactly, as in sparse upcycling) instead
    of at 1/E of it under top-1; a constant factor can be read as part of the experts' down
    projections, so the model class is the paper's. The scale is fixed when the router is built: changing
    ``top_k`` at run time does not rescale the experts. p stays differentiable, so the router learns even
    at top-1."""

    kind = "softmax_topk"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, scale: float | None = None,
                 **_: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.expert_scale = num_experts / top_k if scale is None else float(scale)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)

    def spec(self) -> dict[str, Any]:
        return top_k_spec(self, scale=self.expert_scale)

    expected_experts = top_k_experts
    set_option = set_top_k

    def linear_form(self) -> LinearForm:
        """Softmax probabilities of a linear score; the constant scale is the layer's ``expert_scale``."""
        return LinearForm(self.proj.weight.detach().double(), self.top_k, "softmax")

    forward = top_k_dispatch

    def choose(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(self.proj(x).float(), dim=-1)  # p: (tokens, experts)
        weight, chosen = torch.topk(probs, self.top_k, dim=-1)  # (tokens, k)
        return chosen, weight.to(x.dtype)


class ArgmaxRouter(nn.Module):
    """ToMoE's MLP router after conversion (Eq. 13): logits x W^T (``proj``, no bias), the ``top_k``
    highest experts (top-1 in the paper) each with weight 1: G is one-hot and the expert output is not
    scaled. A constant weight passes no gradient to ``proj``, so where ``proj`` trains (a recovery after
    the conversion) the weight is 1 + p - sg(p), p the chosen experts' softmax probabilities: still 1
    exactly, with the straight-through gradient of a Switch-style router (raise the logit of an expert
    whose output the loss wants more of)."""

    kind = "argmax"
    expert_scale = 1.0

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, **_: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)

    spec = top_k_spec
    expected_experts = top_k_experts
    set_option = set_top_k

    def linear_form(self) -> LinearForm:
        return LinearForm(self.proj.weight.detach().double(), self.top_k, "unit")

    forward = top_k_dispatch

    def choose(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.proj(x)
        chosen = logits.topk(self.top_k, dim=-1).indices
        weight = torch.ones(chosen.shape, dtype=x.dtype, device=x.device)
        if torch.is_grad_enabled() and self.proj.weight.requires_grad:  # straight-through: p - sg(p) is exactly 0
            p = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            weight = weight + (p - p.detach()).to(x.dtype)
        return chosen, weight


class RandomRouter(nn.Module):
    """Random routing (MoRE's MoRE-Random ablation, Table 6): the ``top_k`` experts of largest score
    x . w_i for a fixed random Gaussian w_i drawn at conversion, unit weight. Which expert a token gets
    has nothing to do with what the experts hold; drawing it from the token (rather than a fresh random
    number per call) keeps the model deterministic, so a saved model reloads to the same logits, and
    makes it a linear router that standard formats run. About balanced: each direction wins an equal
    share of tokens in expectation."""

    kind = "random"
    expert_scale = 1.0

    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 1, **_: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.register_buffer("directions", torch.zeros(num_experts, hidden_size))

    expected_experts = top_k_experts
    set_option = set_top_k

    def spec(self) -> dict[str, Any]:
        return top_k_spec(self)

    def linear_form(self) -> LinearForm:
        return LinearForm(self.directions.detach().double(), self.top_k, "unit")

    forward = top_k_dispatch

    def choose(self, x: Tensor) -> tuple[Tensor, Tensor]:
        chosen = torch.topk(x.float() @ self.directions.float().T, self.top_k, dim=-1).indices
        return chosen, torch.ones_like(chosen, dtype=x.dtype)


ROUTERS: dict[str, type[nn.Module]] = {router.kind: router for router in (
    RepresentativeRouter, PrototypeRouter, ThresholdRouter, SoftmaxTopKRouter, ArgmaxRouter, RandomRouter)}
