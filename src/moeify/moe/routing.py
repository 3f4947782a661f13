"""How routing behaved on the data a model saw: per-layer expert load and its divergence from uniform."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from moeify.runtime.moe import MoeMLP


def jsd_to_uniform(counts: list[int]) -> float:
    """Jensen-Shannon divergence (base 2, in [0, 1]) of the empirical routing distribution p from the
    uniform u over the same experts: JSD = KL(p||m)/2 + KL(u||m)/2, m = (p+u)/2 (MoRE Eq. 18)."""
    total = sum(counts)
    if total == 0:
        return 0.0
    p = [c / total for c in counts]
    u = 1 / len(counts)

    def kl(a: list[float], m: list[float]) -> float:
        return sum(x * math.log2(x / y) for x, y in zip(a, m) if x > 0)

    mid = [(x + u) / 2 for x in p]
    return kl(p, mid) / 2 + kl([u] * len(p), mid) / 2


def routing_summary(model: nn.Module) -> list[dict[str, Any]]:
    """One entry per routed MoE layer: its path, tokens per expert (from the layer's tracked stats) and
    the JSD of that load from uniform."""
    summary = []
    for name, module in model.named_modules():
        if isinstance(module, MoeMLP) and module.router is not None and module.stats_tokens:
            load = module.stats_expert_tokens.tolist()
            summary.append({"layer": name, "load": load, "jsd": jsd_to_uniform(load)})
    return summary
