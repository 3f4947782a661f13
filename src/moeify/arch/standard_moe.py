"""The MoE blocks of architectures that transformers implements, counted for activated parameters: the
standard exports moeify writes (``qwen2_moe``, ``glm4_moe``, ``mixtral``, ``granitemoeshared``) and any
other model of those types, so that ``moeify eval`` and ``moeify bench`` measure them like native
conversions (``moe.accounting``). Their module names live here, with the other families' (``arch``).

Per decoder layer: the attention projections, the MLP outside its routed experts (shared experts, a
dense layer's whole MLP) and ``num_experts_per_tok / E`` of the routed experts (every token runs exactly
that many), each expert at its stored width: zero padding included, because the engine computes it.
Routers (and Qwen2-MoE's shared-expert gate) are counted apart, as in ``moe.accounting``.

APR's denominator is the dense model an export came from, written into the export's config
(``DENSE_REFERENCE_KEY``: its attention and MLP projection counts); a MoE model without one is its own
reference (every expert counted), the usual "activated / total parameters" of a native MoE.
"""

from __future__ import annotations

from torch import nn

from moeify.runtime.moe import MoeMLP

DENSE_REFERENCE_KEY = "moeify_dense_reference"
MLP_NAMES = ("mlp", "block_sparse_moe")  # the MoE block's name in a decoder layer
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
EXPERT_NAMES = ("experts", "input_linear", "output_linear")  # GraniteMoe keeps its experts as two linears


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.get_decoder().layers)


def _params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _routed(layer: nn.Module) -> nn.Module | None:
    """The layer's MoE block, or None for a dense layer."""
    for name in MLP_NAMES:
        block = getattr(layer, name, None)
        if block is not None and any(hasattr(block, e) for e in EXPERT_NAMES):
            return block
    return None


def is_standard_moe(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers MoE architecture (routed experts in transformers' own blocks,
    not moeify's ``MoeMLP``)."""
    if not getattr(model.config, "num_experts_per_tok", None) or any(isinstance(m, MoeMLP) for m in model.modules()):
        return False
    try:
        layers = decoder_layers(model)
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return any(_routed(layer) for layer in layers)


def _num_experts(block: nn.Module) -> int:
    experts = next(getattr(block, name) for name in EXPERT_NAMES if hasattr(block, name))
    count = getattr(experts, "num_experts", None)
    return int(count) if count else next(experts.parameters()).shape[0]


def layer_counts(layer: nn.Module, top_k: int) -> tuple[int, float, int, int]:
    """(attention projection params, active MLP params per token, router params, stored MLP params)."""
    attention = sum(_params(m) for m in layer.self_attn.modules() if isinstance(m, nn.Linear))
    block = _routed(layer)
    if block is None:
        mlp = next(_params(getattr(layer, name)) for name in MLP_NAMES if hasattr(layer, name))
        return attention, float(mlp), 0, mlp
    router = sum(_params(getattr(block, name, None)) for name in ROUTER_NAMES)
    experts = sum(_params(getattr(block, name, None)) for name in EXPERT_NAMES)
    shared = _params(getattr(layer, "shared_mlp", None))  # GraniteMoeShared keeps it beside the block
    stored = _params(block) + shared - router
    return attention, stored - experts + experts * top_k / _num_experts(block), router, stored
