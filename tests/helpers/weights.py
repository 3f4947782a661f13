"""Random MLP weights for layer-level tests, and bit-exact comparison of two models' weights."""

from __future__ import annotations

import torch

from moeify.arch.mlp import MlpWeights


def random_mlp(d=16, d_h=30, gated=True, bias=False, seed=0) -> MlpWeights:
    """A random MLP (``d`` -> ``d_h`` -> ``d``), SiLU-gated or GELU, with or without biases."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.3 * torch.randn(*s, generator=g)  # noqa: E731
    return MlpWeights(up=r(d_h, d), down=r(d, d_h), act="silu" if gated else "gelu", gate=r(d_h, d) if gated else None,
                      up_bias=r(d_h) if bias else None, gate_bias=r(d_h) if (bias and gated) else None,
                      down_bias=r(d) if bias else None)


def layer_bytes(layer: torch.nn.Module) -> int:
    """What a layer holds: parameters, buffers and, at inference, an MoE layer's packed copy."""
    held = [*layer.parameters(), *layer.buffers()]
    packed = getattr(layer, "_packed", None)
    if packed is not None:
        held += [t for t in vars(packed[1]).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in held)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """``a`` and ``b`` hold the same state-dict keys and bit-identical tensors (parameters and buffers)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
