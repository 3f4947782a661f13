"""MoRE: Less Prune, MoRE Experts — Recognizing and Restructuring Latent Experts (Zhang et al.).

Per converted layer, from calibration activations streamed one decoder layer at a time:

1. Statistics (§2.2, Eq. 3-7): activation channel sets S(t) = TopK(|h|, k_act), k_act =
   max(1, floor(act_ratio m)), act_ratio 0.05 by default (the paper gives only App. D.2's 7-14 of 14,336
   channels); frequency f, co-activation C and the mean squares E[x^2], E[h^2],
   accumulated on the fly (``CoActivation``: memory O(m^2)).
2. Backbone (Eq. 8): the k_share channels of largest importance s_j (Eq. 7). The paper writes Eq. 7
   for the up projection only ("we will not consider gate projections"); gated MLPs use W_up alone.
3. Petals: spectral clustering of C over the non-shared channels with its diagonal zeroed into r
   clusters; experts E_i = S_i U C_share. Petal sizes are bounded to [min_size_ratio, max_size_ratio]
   x the mean petal size (§E.5 fixes such a range without giving it): oversize petals shed their
   least-linked channels, undersize ones take the best-linked channels of petals that can spare them
   (``bound_cluster_sizes``).
4. Routing (§2.3, Eq. 9-13): calibration tokens are assigned to the expert of largest activation energy
   |h_{E_i}|_2 / |E_i|^alpha (alpha 0 by default: Eq. 9 gives it no value); each expert's prototype mu_i is the mean MLP input x of its tokens; at
   inference the token goes to the expert of largest cosine similarity (top-1, unit weight). An expert
   no calibration token chose keeps a zero prototype (similarity 0).
5. Layer selection and budget (§E.4, F.2): see ``more_budget``; the achieved PR (uniform routing) is
   recorded.

act_ratio and alpha were chosen on calibration text only (``benchmarks/bench_more_sweep.py``, SmolLM2-135M,
calibrated on one half of WikiText-2 valid and scored on the other, PR 0.2; perplexities in
``benchmarks/results/more_sweep.jsonl``): at act_ratio 0.05 alpha 0 beats 0.5 and 0.5 beats 1, by several
percent each; at alpha 0 act_ratio 0.05 and 0.1 tie, several percent ahead of 0.02; at alpha 0.5 the
ratios 0.001-0.1 lie within a tenth of each other, best at 0.05.

The layer is an ``MoeMLP`` whose shared part is the backbone and whose experts are the petals, so only
the backbone and the chosen petal are computed.

Variants (§E.1-E.3): ``backbone`` keeps, statically, the top channels by importance at the same
budget (k_share + mean petal size per layer: MoRE-Backbone); ``random`` is Table 6's MoRE-Random: the
same backbone and petals, tokens assigned to petals at random (``runtime.routers.RandomRouter``: a
fixed random direction per petal, so the assignment is deterministic per token and unrelated to the
petals' content); ``random_petals`` replaces the spectral petals by random ones of the same sizes,
routed as MoRE, so that it measures what the spectral clustering alone contributes; ``naive`` spectrally clusters all channels of a layer into
n_c disjoint experts with no backbone, routed top-1 like MoRE, with n_c (closest to r) and the number
of converted layers solved so that its PR matches the full variant's (Table 10).
"""

from __future__ import annotations

from moeify.methods.base import Deferred, Method
from moeify.methods.more.config import MoreConfig, match_budget

MORE = Method(
    name="more",
    paper="Zhang et al., Less Prune, MoRE Experts: Recognizing and Restructuring Latent Experts for Model Compression",
    summary="training-free: co-activation backbone + spectral petals, cosine-prototype routing, layer budget",
    config_cls=MoreConfig,
    convert=Deferred("moeify.methods.more.convert", "convert"),
    match_budget=match_budget,
    paper_ratio="uniform",
    partitions_mlp=True,
    memory=Deferred("moeify.methods.more.memory", "memory"),
    layer_by_layer=True,
)

__all__ = ["MORE", "MoreConfig"]
