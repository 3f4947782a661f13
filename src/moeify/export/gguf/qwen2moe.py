"""A ``qwen2_moe`` export (softmax expert weights, not renormalised: Dense2MoE's) in the form llama.cpp's
``qwen2moe`` computes: every layer routed, one expert count and width, no dense layer.

- A dense layer (``mlp_only_layers``) becomes E identical experts under a zero router: the softmax gives
  each 1/E, the top-k of them sum to k/E, and down projections scaled by E/k give back the dense MLP (up to
  float rounding). The file therefore holds E copies of every dense layer's MLP. A dense MLP narrower than
  the experts is padded with zero neurons; a wider one does not fit.
- llama.cpp computes the shared expert's gate as silu(g) / g, undefined at g = 0, where the export's zero
  gate vector puts every token. Such an export's shared expert must be zero (Dense2MoE has none; transformers
  needs the tensors): its gate vector becomes ones, g = the sum of the token's inputs, and the zero expert
  contributes 0 for every token whose inputs do not sum to exactly 0.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor
from transformers import PretrainedConfig

from moeify.export.formats.common import mlp_tensors
from moeify.export.gguf.tensors import UnmappedTensor
from moeify.export.hf_parts import GatedMlp

_DENSE = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert\.down_proj\.weight")


def all_routed(state: dict[str, Tensor], config: PretrainedConfig) -> dict[str, Tensor]:
    """``state`` of a transformers ``qwen2_moe`` model with its dense layers as routed layers of identical
    experts and a nonzero gate on its (zero) shared experts (see the module docstring)."""
    experts, top_k = config.num_experts, config.num_experts_per_tok
    width = config.moe_intermediate_size
    out: dict[str, Tensor] = {}
    dense: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        if match := _DENSE.fullmatch(key):
            dense.setdefault(int(match.group(1)), {})[match.group(2)] = value
            continue
        if (match := _SHARED.fullmatch(key)) and value.abs().max() > 0:
            raise UnmappedTensor(f"layer {match.group(1)}'s shared expert is not zero: llama.cpp's qwen2moe gates it "
                                 "by sigmoid(x . w), which no w holds at 1/2 for every token")
        out[key] = value
        if key.endswith("mlp.shared_expert_gate.weight"):
            out[key] = torch.ones_like(value)
    for index, mlp in dense.items():
        if mlp["up"].shape[0] > width:
            raise UnmappedTensor(f"layer {index}'s dense MLP is {mlp['up'].shape[0]} wide, more than the experts' "
                                 f"{width}: llama.cpp's qwen2moe has one expert width")
        pad = width - mlp["up"].shape[0]
        gate, up = (torch.nn.functional.pad(mlp[name], (0, 0, 0, pad)) for name in ("gate", "up"))
        down = torch.nn.functional.pad(mlp["down"], (0, pad)) * (experts / top_k)  # the top-k weigh k / E in all
        prefix = f"model.layers.{index}.mlp."
        out[prefix + "gate.weight"] = gate.new_zeros(experts, gate.shape[1])  # softmax(0): 1/E each
        out[prefix + "experts.gate_up_proj"] = torch.cat([gate, up]).expand(experts, -1, -1).contiguous()
        out[prefix + "experts.down_proj"] = down.expand(experts, -1, -1).contiguous()
        zero = gate.new_zeros(config.shared_expert_intermediate_size, gate.shape[1])
        out.update(mlp_tensors(prefix + "shared_expert.", GatedMlp(zero, zero, zero.T.contiguous())))
        out[prefix + "shared_expert_gate.weight"] = gate.new_ones(1, gate.shape[1])
    return out
