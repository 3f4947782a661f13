"""TEAL: Training-Free Activation Sparsity in Large Language Models (Liu et al., 2024), the baseline a user
tries before any MoE conversion.

Every projection of every decoder layer (attention q/k/v/o, MLP gate/up/down) zeroes the entries of its
input whose magnitude is below a threshold, so the matching weight columns take no part in the product.
Each threshold is the ``sparsity`` quantile of |x| over the calibration tokens reaching that projection
(TEAL §4: hidden states are zero-mean and unimodal, so a magnitude cut-off at a quantile zeroes that
fraction of them), measured layer by layer on the outputs of the already-sparsified layers.

Choices:
- The same sparsity for every projection (TEAL's "uniform" allocation). TEAL's default allocates
  sparsity per projection by a block-wise greedy search on activation errors; that search is not
  implemented here, so this baseline sits a little below TEAL's best at the same level.
- Activated parameters are the weight columns of the kept inputs, counted per token on the data the
  model is evaluated on (``moe.accounting``); APR ~ 1 - sparsity.
- Every cut-off is a step: an input crossing one changes the next projection by a whole threshold's worth,
  and that cascades through the layers, so the perplexity of a TEAL model moves by a few percent under
  perturbations of its inputs far below bfloat16's rounding (``benchmarks/bench_precision_floor.py``:
  on SmolLM2 even at 16 float32 ulps). Its bfloat16 and float32 runs differ by that much.
- A recovery (``recover_tokens``) trains the weights the thresholds were calibrated on: the inputs' magnitudes
  move, and with them the share each fixed cut-off keeps. The thresholds are therefore calibrated again on the
  conversion's windows after it (``refit``), so the recovered model holds the sparsity it was converted at.
- The inference path is a masked dense product (``runtime.sparse_inputs``): PyTorch has no kernel that
  skips the zeroed columns, so a TEAL model runs at dense speed here; its quality is what it is compared
  on. Standard MoE export formats do not apply (it has no experts).
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.teal.config import TealConfig, match_budget

TEAL = Method(
    name="teal",
    paper="baseline: Liu et al., Training-Free Activation Sparsity in Large Language Models (TEAL), 2024 "
          "(arXiv:2408.14690)",
    summary="baseline: magnitude thresholds on every projection's inputs, calibrated to a target sparsity",
    config_cls=TealConfig,
    convert=Deferred("moeify.methods.teal.convert", "convert"),
    refit=Deferred("moeify.methods.teal.convert", "refit"),
    memory=Deferred("moeify.methods.teal.memory", "memory"),
    match_budget=match_budget,
    inference_copy=False,
    layer_by_layer=True,
    keeps_attention=lambda _config: False,
)

__all__ = ["TEAL", "TealConfig"]
