"""Experts: slices of a dense MLP's neurons, as ``nn.Linear`` modules so that adapters (LoRA) can wrap
them. Part of the runtime copied into every converted folder (imports torch and transformers only)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.activations import ACT2FN


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

    def forward_float32(self, x: Tensor) -> Tensor:
        """``forward`` in float32 whatever the weights' dtype (a router's scores: a bfloat16 model then picks
        the experts its float32 twin picks, instead of flipping near-ties on bfloat16 rounding). Projections
        wrapped by an adapter (LoRA while fine-tuning) run as they are."""
        if type(self.up) is not nn.Linear or (self.gate is not None and type(self.gate) is not nn.Linear):
            return self(x).float()

        def linear(module: nn.Linear, x: Tensor) -> Tensor:
            bias = None if module.bias is None else module.bias.float()
            return F.linear(x, module.weight.float(), bias)

        x = x.float()
        if self.gate is None:
            return self.act(linear(self.up, x))
        return self.act(linear(self.gate, x)) * linear(self.up, x)


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


class SharedNeuronExperts(nn.Module):
    """Experts that overlap (ToMoE's neuron subsets of one dense MLP), stored once: the union of their
    neurons as one ``HiddenNeurons`` + down projection, and each expert as positions in that union
    (``index``: (experts, width), a buffer), the official code's masks as index lists. Expert ``e`` is
    the union's rows ``index[e]``: the saved model holds the union once (about the dense MLP), and the
    training path gathers an expert's rows when it runs (inference runs a packed copy of the experts,
    ``runtime.moe``). ``neuron_ids``: each union neuron's index in the dense MLP."""

    def __init__(self, hidden_size: int, union_width: int, num_experts: int, width: int, act: str, gated: bool,
                 up_bias: bool) -> None:
        super().__init__()
        self.neurons = HiddenNeurons(hidden_size, union_width, act, gated, up_bias)
        self.down = nn.Linear(union_width, hidden_size, bias=False)
        self.register_buffer("index", torch.zeros(num_experts, width, dtype=torch.int32))
        self.register_buffer("neuron_ids", torch.arange(union_width, dtype=torch.int32))

    def __len__(self) -> int:
        return self.index.shape[0]

    @property
    def widths(self) -> list[int]:
        return [self.index.shape[1]] * len(self)

    def expert_neurons(self) -> list[list[int]]:
        """Each expert's neurons as indices of the dense MLP."""
        return self.neuron_ids[self.index].tolist()

    def expert_output(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on the tokens ``x`` (tokens, d)."""
        n, rows = self.neurons, self.index[e]
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        h = F.linear(x, pick(n.up.weight), pick(n.up.bias))
        h = n.act(F.linear(x, pick(n.gate.weight), pick(n.gate.bias))) * h if n.gate is not None else n.act(h)
        return F.linear(h, self.down.weight.index_select(1, rows))

    def expert(self, e: int) -> ExpertMLP:
        """Expert ``e`` as its own module (a copy: what an export writes)."""
        n, rows = self.neurons, self.index[e]
        module = ExpertMLP(n.up.in_features, len(rows), n.act_name, n.gated, n.up.bias is not None).to(n.up.weight)
        with torch.no_grad():
            for source, target in ((n.up, module.neurons.up), (n.gate, module.neurons.gate)):
                if source is not None:
                    target.weight.copy_(source.weight[rows])
                    if source.bias is not None:
                        target.bias.copy_(source.bias[rows])
            module.down.weight.copy_(self.down.weight[:, rows])
        return module
