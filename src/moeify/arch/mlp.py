"""Family-independent view of a decoder MLP as plain tensors.

Every supported family computes ``down(act(gate(x)) * up(x))`` (gated: LLaMA, Qwen, Mistral, Phi-3)
or ``down(act(up(x)))`` (two-layer: GPT-NeoX, Phi). The input of ``down`` is the hidden activation
``h`` in both cases, and each hidden neuron ``i`` owns row ``i`` of ``up``/``gate`` and column ``i`` of
``down``. That is why a neuron subset of an MLP is again an MLP (``select``), and why the sum of the
outputs of a partition of the neurons equals the dense output plus the output bias (CMoE Eq. 3/19).

Weights use the ``nn.Linear`` layout: ``up``/``gate`` are ``(d_h, d)``, ``down`` is ``(d, d_h)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from transformers.activations import ACT2FN


@dataclass(frozen=True)
class MlpWeights:
    """The tensors of one MLP. ``gate is None`` means a two-layer (non-gated) MLP."""

    up: Tensor
    down: Tensor
    act: str
    gate: Tensor | None = None
    up_bias: Tensor | None = None
    gate_bias: Tensor | None = None
    down_bias: Tensor | None = None

    @property
    def hidden_size(self) -> int:
        """d: the model width."""
        return self.up.shape[1]

    @property
    def intermediate_size(self) -> int:
        """d_h: the number of hidden neurons."""
        return self.up.shape[0]

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def num_params(self) -> int:
        """Projection parameters (weights and biases), the unit of activated-parameter accounting."""
        return sum(t.numel() for t in self._tensors())

    def params_per_neuron(self) -> int:
        """Parameters owned by one hidden neuron: a row of up (+gate) and a column of down, with biases."""
        per = 2 * self.hidden_size + (self.hidden_size if self.gated else 0)
        per += int(self.up_bias is not None) + int(self.gate_bias is not None)
        return per

    def _tensors(self) -> list[Tensor]:
        return [t for t in (self.up, self.down, self.gate, self.up_bias, self.gate_bias, self.down_bias) if t is not None]

    def hidden(self, x: Tensor) -> Tensor:
        """h = act(x W_gate + b_gate) * (x W_up + b_up), or act(x W_up + b_up) without a gate. (..., d_h)"""
        act = ACT2FN[self.act]
        up = torch.nn.functional.linear(x, self.up, self.up_bias)
        if self.gate is None:
            return act(up)
        return act(torch.nn.functional.linear(x, self.gate, self.gate_bias)) * up

    def forward(self, x: Tensor) -> Tensor:
        """The dense MLP output, bias included: (..., d)."""
        return torch.nn.functional.linear(self.hidden(x), self.down, self.down_bias)

    def select(self, neurons: Tensor) -> "MlpWeights":
        """The sub-MLP of the given hidden neurons. The output bias is dropped: it belongs to the layer
        once, not to every part (see ``down_bias`` on the MoE layer)."""
        idx = neurons.to(device=self.up.device, dtype=torch.long)
        pick = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
        return replace(
            self,
            up=pick(self.up),
            gate=pick(self.gate),
            up_bias=pick(self.up_bias),
            gate_bias=pick(self.gate_bias),
            down=self.down.index_select(1, idx),
            down_bias=None,
        )

    def to(self, **kwargs) -> "MlpWeights":
        """Move/cast every tensor (``device=``, ``dtype=``)."""
        move = lambda t: None if t is None else t.to(**kwargs)  # noqa: E731
        return replace(
            self,
            up=move(self.up),
            down=move(self.down),
            gate=move(self.gate),
            up_bias=move(self.up_bias),
            gate_bias=move(self.gate_bias),
            down_bias=move(self.down_bias),
        )
