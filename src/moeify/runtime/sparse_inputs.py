"""Projections whose small inputs are zeroed: TEAL's training-free activation sparsity (Liu et al., 2024).

Part of the runtime copied into every converted folder, like ``moe.py`` (imports torch only).

``ThresholdedLinear`` is an ``nn.Linear`` (same parameter names, so a checkpoint keeps the base layout)
plus a calibrated magnitude threshold t: y = W (x * [|x| > t]) + b. The columns of W that meet a zeroed
input take no part in the product, which is what the activated parameters count; the product itself
is a masked dense one here, because PyTorch has no kernel that skips the zeroed columns (TEAL's speed-up
comes from its own Triton kernels), so a TEAL model runs at dense speed in moeify.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class ThresholdedLinear(nn.Linear):
    """See the module docstring. ``sparsity`` is the fraction of inputs the threshold was calibrated to
    zero (the nominal count); ``stats_*`` count, while ``track_stats`` is on, the inputs seen and kept.

    The threshold stays float32 whatever the weights' dtype (``float32_buffers``: casts move it but keep
    its dtype) and inputs are compared with it in float32: t rounded to bfloat16 moves by up to 0.4 %,
    which moves the share of inputs kept."""

    float32_buffers = ("threshold",)

    def __init__(self, in_features: int, out_features: int, bias: bool, sparsity: float,
                 threshold: float = 0.0) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.sparsity = sparsity
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.track_stats = False
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats_inputs = 0
        self.stats_kept = 0

    def _apply(self, fn: Any, recurse: bool = True) -> "ThresholdedLinear":
        kept = {name: getattr(self, name) for name in self.float32_buffers}
        super()._apply(fn, recurse)
        for name, value in kept.items():  # the cast's device, the buffer's own dtype
            setattr(self, name, value.to(device=getattr(self, name).device))
        return self

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu" and not self.track_stats and not torch.compiler.is_compiling():
            return super().forward(nn.functional.hardshrink(x, self.cutoff(x.dtype)))
        keep = x.abs().to(torch.float32) > self.threshold
        if self.track_stats:
            self.stats_inputs += keep.numel()
            self.stats_kept += int(keep.sum())
        return super().forward(x * keep)

    def cutoff(self, dtype: torch.dtype) -> float:
        """The threshold as ``hardshrink``'s lambda for inputs of ``dtype``: on a CPU one pass over x (x where
        |x| > lambda, else 0) costs a tenth of the magnitude, the comparison and the product taken apart, and
        reading t back costs nothing there (on a GPU, or in a compiled graph, the three fuse or the read would
        wait for the device, so the tensor comparison stays). hardshrink compares in ``dtype``, so lambda is t
        rounded down to a ``dtype`` value: for x of that dtype, |x| > lambda exactly where |x| > t."""
        t = self.threshold
        low = t.to(dtype)
        if low.float() > t:
            low = torch.nextafter(low, torch.zeros_like(low))
        return float(low)

    def kept_fraction(self, measured: bool) -> float:
        """The share of inputs (hence of weight columns) used per token: counted on the data seen while
        ``track_stats`` was on, or the calibrated 1 - sparsity."""
        if measured and self.stats_inputs:
            return self.stats_kept / self.stats_inputs
        return 1.0 - self.sparsity

    def spec(self) -> dict[str, Any]:
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None,
                "sparsity": self.sparsity}


def install_sparse_inputs(model: nn.Module, moeify_block: dict[str, Any]) -> None:
    """Replace the linear layers listed under ``moeify_block["sparse_inputs"]`` ({path: spec}); their
    weights and thresholds come from the checkpoint."""
    for path, spec in (moeify_block.get("sparse_inputs") or {}).items():
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, ThresholdedLinear(**spec))


def sparse_input_specs(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {name: module.spec() for name, module in model.named_modules() if isinstance(module, ThresholdedLinear)}
