"""Dense2MoE: Unifying Pruning and Upcycling for Efficient Large Language Models (anonymous, under review).

1. Inter-layer similarity (§2.2, Eq. 4-5; ``calibration.similarity``): S_L, the mean per-token cosine of
   decoder-layer outputs x^(l), and S_M, that of MLP inputs h^(l), for every pair of layers, streamed one
   decoder layer at a time; both matrices go to the record and, as heatmaps (Fig. 3), next to the model.
2. Selection (§2.3): spans (l, n) in descending S_L order; the first whose fused MLPs would read inputs
   close enough to h^(l) is taken as (l*, n*). The paper writes the condition s(h^(l), h^(l+n)) < delta
   while calling these inputs similar, and introduces it as a distance d(h^(l), h^(l+n)); we read it as
   that distance, d = 1 - s < delta, and require it of every fused layer (k = 1 .. n*: each of their
   MLPs will be fed h^(l*)), not only of the last. ``prune_layers`` is k of §4.1, the layers removed in
   all; by default the paper's share (its main setting prunes the top-5 redundant layers of
   Qwen2.5-0.5B's 24, with N = 6 experts: one span of 5 fused into its kept layer), rounded: 1 of
   stories260K's 5 layers, 6 of SmolLM2's 30. ``spans`` splits them into that many separate spans
   (sizes differing by at most one), each fused into its own kept layer: §4.1's "top-k redundant
   layers" need not be contiguous, while §2.3 describes one span. They are chosen greedily, largest
   first, each the first in S_L order that qualifies and shares no layer with those already chosen.
   ``search`` is §2.3's search as written instead: n* free, one span, the first in S_L order of any
   length that qualifies.
   delta = 0.3 (the paper gives no value) lets adjacent layers of stories260K qualify (their distances
   well below it) and spans of two (just below it).
3. Pruning and Layer-Fusion Upcycling (Eq. 6): layers l*+1 .. l*+n* are removed entirely, not only their
   attention: §2 "retain the first layer ..., drop all subsequent layers, and retain their MLPs in the
   first layer as experts", and Eq. 6 goes from x^(l*-1) to x^(l*+n*) through MHA^(l*) alone. Their
   MLPs live on as experts of layer l*'s MoE: N (``num_copies``) copies of l*'s MLP and M
   (``copies_per_pruned``) copies of each removed layer's, all reading h^(l*) (through l*'s MLP norm).
   The model stays a plain, shorter model of its family (``moe.depth``): generation with a KV cache,
   saving and both loading paths need nothing special, and the accounting keeps the dense total.
   Choices the paper leaves open:
   - the paper's MLP^(l) reads the pre-norm h (Eq. 3), so it includes its own norm: each removed
     layer's norm weight is folded into its experts' input projections (``fold_mlp_norm``, exact), so
     that expert computes MLP^(l*+k)(h^(l*)) as Eq. 6 writes it;
   - the router is the softmax top-k of §2.1 with weights p_i as §2.1 writes them (``router_weighting=
     upcycle``: p_i * E / k, so that an untrained router's weights sum to 1), reading the normed MLP
     input as every Hugging Face MoE does;
     W_g ~ N(0, initializer_range^2) from the seed, so identical copies get different tokens from the
     first step and training breaks their symmetry;
   - what these choices do at top-1 with one removed layer on stories260K (held-out perplexity after
     the default budget, seed 0, unless noted; ``benchmarks/bench_dense2moe.py``): ``lfuc`` beats both
     baselines by under a percent with the paper's weights p_i, and by about a percent with
     ``router_weighting=upcycle``, whose router ends sending nearly every token to the kept MLP. At
     top-1 one MLP replaces the other for a token; on the calibration tokens the removed layer's MLP
     restores the dense layers' residual update better than the kept one for over a third of the
     tokens, but only by little: the per-token best choice lowers the squared error of always taking the
     kept MLP by about a tenth, the best linear router (right for about three tokens in four) by about a
     percent, running both (top-2) by more than a quarter. The alternatives tried do not change that:
     W_g = 0 (every token ties to the kept MLP, the fused one never gets a token: ``lfuc`` becomes
     ``prune_upcycle`` exactly), W_g fitted to that per-token best choice (untrained, better than the
     random router but still worse than ``prune_only``), the removed MLP reading l*'s normed input
     without folding its own norm. The paper's p_i is the default although E / k measured better on
     stories260K, as the paper writes it. The learning rate decides the order (``dense2moe_train``);
     top-2 is decisive (about a tenth below ``prune_only``);
   - a norm after the MLP (Gemma-2/3's post_feedforward_layernorm; OLMo-2, which has no norm before it)
     stays the kept layer's: the MoE's output passes it, and a removed layer's own post-MLP norm is not
     carried over (an RMSNorm of an output cannot be folded into weights), so that expert approximates
     MLP^(l*+k) there; the norm before the MLP is folded exactly, as its effective gamma (1 + w for Gemma);
   - an output bias (GPT-NeoX, Phi) cannot be routed per expert in ``ExpertMLP``: the layer keeps l*'s,
     added once; the removed layers' output biases are dropped (the fine-tuning re-learns the offset).
   Activated parameters count the top-k experts (each a whole MLP) and no attention for the removed
   layers, against the dense model's total: replicated experts add parameters, not compute savings per
   se; the savings are the removed attention and, for k < number of fused MLPs, the MLPs not run.
4. Fine-tuning (§3.1, ``dense2moe_train``): every parameter, LM loss, warm-up then cosine decay. The
   defaults are a budget for a 2-core CPU on stories260K (``benchmarks/bench_dense2moe.py``); the
   training text is the calibration text.
5. ``variant`` (Table 5 and its baselines): ``lfuc`` (the method), ``prune_upcycle`` (the same removal,
   the MoE built from N + n* M copies of l*'s MLP alone) and ``prune_only`` (ShortGPT-style removal of
   the same layers, no MoE); the fine-tuning is the same for all three.
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.dense2moe.config import Dense2moeConfig, match_budget

DENSE2MOE = Method(
    name="dense2moe",
    paper="Dense2MoE: Unifying Pruning and Upcycling for Efficient Large Language Models (anonymous, under "
          "review)",
    summary="remove redundant layers (similarity of layer outputs / MLP inputs), fuse their MLPs as experts "
            "of the kept layer (softmax top-k), fine-tune",
    config_cls=Dense2moeConfig,
    convert=Deferred("moeify.methods.dense2moe.convert", "convert"),
    memory=Deferred("moeify.methods.dense2moe.memory", "memory"),
    match_budget=match_budget,
    model_analysis=Deferred("moeify.methods.dense2moe.analysis", "similarity_analysis"),
    paper_ratio="model",
)

__all__ = ["DENSE2MOE", "Dense2moeConfig"]
