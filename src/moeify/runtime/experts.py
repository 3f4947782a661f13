"""Experts: slices of a dense MLP's neurons, as ``nn.Linear`` modules so that adapters (LoRA) can wrap
them. Part of the runtime copied into every converted folder (imports torch and transformers only)."""

from __future__ import annotations

from torch import Tensor, nn
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
