"""The option of the least-squares output refit (``refit.py``) that a method config inherits: a module of
its own, free of torch, so that a command validates it before it imports the conversion code."""

from __future__ import annotations

import dataclasses

from moeify.options import MethodOptions, option


@dataclasses.dataclass(frozen=True)
class RefitOptions(MethodOptions):
    """``refit_down``: not in the papers, so off by default (each method as published)."""

    refit_down: bool = option(False, "not part of the published method: refit each converted layer's output "
                                     "projections by least squares to the dense MLP output on the calibration "
                                     "tokens, given its routing (training-free; moe/experts/refit.py)")


def refit_bytes(tokens: int, hidden: int, intermediate: int) -> int:
    """What ``refit_down_`` holds for one layer beside the conversion's other statistics (``moeify plan``), all
    float32: the routed hidden values H_m and the parts' hidden values they are built from, the dense output
    Y, the Gram matrix with its ridge identity and system, and the fitted columns."""
    return 4 * (2 * tokens * intermediate + tokens * hidden + 3 * intermediate * intermediate + intermediate * hidden)
