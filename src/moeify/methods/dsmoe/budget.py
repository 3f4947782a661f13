"""DSMoE at a given activated-parameter ratio: the threshold tau chosen after training.

DSMoE's share of active experts is learned (the sparsity loss, Eq. 17-19), not set, so the paper reports
each model at the tau it trained with and sweeps tau at inference (Appendix A, Table 4). To compare it
with the methods that take a budget, ``active_ratio`` keeps the training as the paper specifies and then
sets the one tau of every layer (a runtime option of the converted model) at which the APR measured on
training-text windows is the target: raising tau only switches gates off, so the APR falls with tau and a
bisection finds the crossing. The gates themselves are not changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moeify.moe.accounting import activated_parameters, moe_layers, tracking_routing

BISECTION_STEPS = 16  # tau to within 2^-16: finer than the APR steps a few thousand tokens resolve


def set_tau_(model: nn.Module, tau: float) -> None:
    for layer in moe_layers(model):
        layer.router.set_option("tau", tau)


@torch.no_grad()
def measured_apr(model: nn.Module, windows: Tensor) -> float:
    """The APR of ``model`` measured on ``windows`` (n, seq_len), one window per forward."""
    device = next(model.parameters()).device
    with tracking_routing(model):
        for window in windows:
            model(input_ids=window[None].to(device), use_cache=False)
        return activated_parameters(model, measured=True).apr


def match_tau_(model: nn.Module, windows: Tensor, target: float) -> dict[str, Any]:
    """Set every layer's tau to the bisection's value whose measured APR on ``windows`` is nearest ``target``
    (tau = 1 passes no gate: the APR of attention alone; the caller checks that the target is above it);
    returns the record's entry: tau, the APR it measured, and the APR at the trained tau."""
    trained = moe_layers(model)[0].router.tau
    low, high = 0.0, 1.0  # APR(low) >= target > APR(high)
    probes = {trained: measured_apr(model, windows)}
    for _ in range(BISECTION_STEPS):
        tau = (low + high) / 2
        set_tau_(model, tau)
        probes[tau] = measured_apr(model, windows)
        low, high = (tau, high) if probes[tau] > target else (low, tau)
    tau = min(probes, key=lambda t: abs(probes[t] - target))
    set_tau_(model, tau)
    return {"tau": tau, "apr": probes[tau], "target_apr": target, "trained_tau": trained,
            "trained_apr": probes[trained], "tokens": windows.numel()}
