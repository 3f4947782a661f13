"""CMoE: Fast Carving of Mixture-of-Experts for Efficient LLM Inference (Pei et al., 2025).

Per decoder layer, on calibration activations streamed one layer at a time:

1. Profiling (§IV-A, Eq. 5-7): H = Swish(X W_gate) * (X W_up) with X normalised per token and the
   weight vectors of W_gate and W_up normalised per neuron (the paper normalises "X, W_gate and W_up"
   without saying along which axis; per-token / per-neuron L2 is our choice: it removes the
   magnitudes the paper wants removed and keeps the per-neuron geometry). For two-layer MLPs H is
   act(X W_up) with the same normalisation and no bias. ATopK marks the ``ka`` neurons of largest |h_i|
   per token; the activation rate mu_i is the mean of neuron i's markers.
2. Shared experts (Eq. 8-9): the neurons with the highest mu.
3. Routed experts (Eq. 10-14): balanced k-means over the marker vectors c_i of the other neurons,
   centroids initialised at the highest-mu non-shared neurons, each assignment solved exactly.
4. Router (Eq. 24-26): each routed expert's representative neuron (closest to its centroid) computes
   the expert's score s = |h_R|; top-``top_k`` experts run with unit weight (Eq. 17), generalised to
   g = 1 + softmax(s)_i u_i with u = 0 and the load-balancing bias b (Eq. 28-33). Eq. 20 minimises the
   L1 norm of the dropped experts' hidden states, so experts are ranked by the expected |h| and h_R
   stands in for it (Eq. 26): the magnitude, as the official code computes it. ``router_score=signed``
   ranks the signed h_R. Measured on SmolLM2-135M (S2A2E16, WikiText-2 valid calibration), the per-layer
   MLP output error of |h_R| is at or below the signed reading's in most layers (``details.analysis``),
   and both stay well above the oracle: the single representative neuron is a coarse estimate of its
   expert's |h|.
5. Optional light fine-tuning (§V, ``training.lora``): LoRA (rank 8, alpha 32, dropout 0 by default,
   the reference code's 0.1 as ``lora_dropout``) plus u at its own learning rate, b moved by gamma
   after every step; one pass over ``finetune_samples`` windows (the paper: 2,048) or
   ``finetune_steps`` random windows.

When d_h is not a multiple of the expert count, expert sizes differ by at most one (larger ones first,
the shared part takes the first ``num_shared`` sizes), so no neuron is dropped. The ``random``
partition is the LLaMA-MoE baseline: shared and routed neurons drawn at random with the same sizes,
the router still built from each group's representative neuron.
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.cmoe.config import CmoeConfig, match_budget

CMOE = Method(
    name="cmoe",
    paper="Pei et al., CMoE: Fast Carving of Mixture-of-Experts for Efficient LLM Inference, 2025 (arXiv:2502.04416)",
    summary="training-free carving: activation profiling, shared experts, balanced k-means, analytic router",
    config_cls=CmoeConfig,
    convert=Deferred("moeify.methods.cmoe.convert", "convert"),
    match_budget=match_budget,
    paper_ratio="ffn",
    partitions_mlp=True,
    memory=Deferred("moeify.methods.cmoe.memory", "memory"),
    layer_by_layer=True,
)

__all__ = ["CMOE", "CmoeConfig"]
