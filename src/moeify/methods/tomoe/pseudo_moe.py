"""ToMoE's runtime option ``pseudo_moe`` (Appendix B.3): run the MoE layers as dense products times 0/1
masks over the union of the experts' neurons instead of gathered experts. The logits are the same
(tested); the option exists to measure what gathering buys. Routed attention always runs that way
(``runtime.attention``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from moeify.moe.accounting import moe_layers
from moeify.options import OptionError, parse_bool


def set_pseudo_moe(model: PreTrainedModel, value: Any) -> Callable[[], None]:
    """Switch pseudo-MoE on or off for every ToMoE layer of ``model``; returns the function that puts the
    previous setting back."""
    on = parse_bool("pseudo_moe", value)
    modules = [layer for layer in moe_layers(model) if layer.shares_neurons]
    if not modules:
        raise OptionError("pseudo_moe applies to models whose experts share neurons (ToMoE); this one has none")
    before = [module.pseudo_moe for module in modules]
    for module in modules:
        module.pseudo_moe = on

    def undo() -> None:
        for module, previous in zip(modules, before):
            module.pseudo_moe = previous

    return undo
