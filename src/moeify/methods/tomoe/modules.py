"""ToMoE's trainable modules Theta (Table 8) and the training-time masks they put on the frozen model.

- ``HyperNetwork`` (Eq. 1): fixed z ~ N(0, 1) -> Bi-GRU(32, 64) -> E_l in R^{N x 128} for every layer.
  The Bi-GRU runs over the layers (a sequence of length L, the N experts as the batch), which is what
  gives E its inter-layer dependencies; z is (L, N, 32): the paper's N x 32 per layer.
- ``LayerModules``: per layer, Router = Linear(d, N) (no bias: see ``tomoe``), Proj_D^MLP = LayerNorm ->
  GeLU -> Linear(128, d_mid), and with attention Proj_E^MHA = Linear(d, 128), Proj_D^MHA (head_dim) for
  the per-token V/O mask s_t and Proj_D^MHA (head_dim / 2) for the static Q/K mask s_0 (Appendix A.1);
  with head pruning one Proj_D (key/value heads) in their place.
- ``st_gumbel_sigmoid`` (Eq. 15) and ``st_gumbel_softmax`` (Eq. 14): hard 0/1 and one-hot forward values,
  the soft sample's gradient (straight-through).
- ``MaskedMLP`` replaces a dense MLP during training: every token is routed (G, one-hot, Eq. 3) and its
  hidden neurons masked by s = ST-GSig(Proj_D^MLP(G E)) (Eq. 2-3); the dense weights stay frozen.
- ``AttentionMasks`` puts hooks on a LLaMA-style attention: q/k outputs times s_0' (s_0's first half
  repeated, Appendix A.2), v outputs and the o_proj input times s_t (Eq. 4-5); with head pruning
  (``attention=heads``, Table 13) the o_proj input of each key/value head's query heads times one static
  mask over the key/value heads, drawn from Proj_D(attention embedding) as s_0 is.
Both switch off (``enabled = False``) for the in-place teacher pass (Listing 1). Both keep the token
statistics the regularisers read only while ``recording``: a decoder layer recomputed in the backward pass
(``training/recompute.py``) runs them again, and statistics kept from that pass would hold its graph, and
every layer's activations in it, until the next step.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from moeify.arch.mlp import MlpWeights
from moeify.methods.tomoe.config import EMBED_DIM, GRU_HIDDEN, Z_DIM
from moeify.training import noise

KEEP_BIAS = 3.0   # b of Eq. 15: every mask starts (almost surely) all ones, "the whole model"


def _uniform(like: Tensor, key: Hashable, per_window: bool) -> Tensor:
    """U(0, 1) samples of ``like``'s shape, clamped off 0 and 1; within a training step the same for a
    window however the batch is split (``training.noise``)."""
    return noise.uniform(like, key, per_window).clamp(1e-6, 1 - 1e-6)


def gumbel_noise(like: Tensor, key: Hashable = None, per_window: bool = True) -> Tensor:
    """Gumbel(0, 1) samples shaped like ``like``: -log(-log u)."""
    return -torch.log(-torch.log(_uniform(like, key, per_window)))


def logistic_noise(like: Tensor, key: Hashable = None, per_window: bool = True) -> Tensor:
    """g1 - g2 for two Gumbel(0, 1) samples: the noise of a two-class Gumbel-softmax. Its median is 0 (the
    Gumbel's is 0.37), but at b = 3 it drops 4.7 % of the neurons of a logit-0 mask from the first step."""
    u = _uniform(like, key, per_window)
    return torch.log(u) - torch.log1p(-u)


MASK_NOISE = {"gumbel": gumbel_noise, "logistic": logistic_noise}


def st_gumbel_sigmoid(logits: Tensor, tau: float, noise: str | None = "gumbel", key: Hashable = None,
                      per_window: bool = True) -> Tensor:
    """Eq. 15: round(sigmoid((x + g + b) / tau)) forward, the sigmoid's gradient backward; g from
    ``MASK_NOISE[noise]`` (the paper: one Gumbel(0, 1) sample), none with ``noise=None``. ``key`` names the
    draw, ``per_window``: ``logits``' first dimension runs over the batch's windows (``training.noise``)."""
    shifted = logits + KEEP_BIAS + (MASK_NOISE[noise](logits, key, per_window) if noise else 0.0)
    soft = torch.sigmoid(shifted / tau)
    return (soft > 0.5).to(soft.dtype) - soft.detach() + soft


def st_gumbel_softmax(logits: Tensor, tau: float, noise: bool = True, key: Hashable = None) -> tuple[Tensor, Tensor]:
    """Eq. 14: (one-hot of argmax (x + g) / tau with the soft sample's gradient, the soft sample itself);
    ``logits``' first dimension runs over the batch's windows."""
    gumbel = gumbel_noise(logits, key) if noise else 0.0
    soft = torch.softmax((logits + gumbel) / tau, dim=-1)
    hard = torch.zeros_like(soft).scatter(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
    return hard - soft.detach() + soft, soft


def projection(out_features: int) -> nn.Sequential:
    """Proj_D: LayerNorm(d_e) -> GeLU -> Linear(d_e, out) (Table 8)."""
    return nn.Sequential(nn.LayerNorm(EMBED_DIM), nn.GELU(), nn.Linear(EMBED_DIM, out_features))


class HyperNetwork(nn.Module):
    def __init__(self, num_layers: int, num_experts: int, seed: int) -> None:
        super().__init__()
        z = torch.randn(num_layers, num_experts, Z_DIM, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("z", z)
        self.gru = nn.GRU(Z_DIM, GRU_HIDDEN, bidirectional=True)

    def forward(self) -> Tensor:
        """E_all: (L, N, d_e)."""
        return self.gru(self.z)[0]


class LayerModules(nn.Module):
    """Theta of one decoder layer (see the module docstring)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, head_dim: int | None,
                 vo_routing: bool = True, local: bool = False, kv_heads: int | None = None) -> None:
        super().__init__()
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.proj_mlp = projection(intermediate_size)
        self.head_pruning = kv_heads is not None
        self.attention = head_dim is not None or self.head_pruning
        self.vo_routing = vo_routing and not self.head_pruning
        self.local_embedding: nn.Parameter | None = None
        if self.head_pruning:  # Table 13's "Head Pruning": one static mask over the key/value heads
            self.proj_heads = projection(kv_heads)
        elif self.attention:
            if vo_routing:  # Proj_E of Eq. 5 reads the token
                self.proj_e = nn.Linear(hidden_size, EMBED_DIM)
            self.proj_vo = projection(head_dim)
            self.proj_qk = projection(head_dim // 2)
        if self.attention and local:  # Table 13's "Local Emb": the attention's own embedding, not (1/N) 1^T E
            self.local_embedding = nn.Parameter(torch.randn(EMBED_DIM))

    def attention_embedding(self, experts: Tensor) -> Tensor:
        """What this layer's attention masks are made from: (1/N) 1^T E of the expert embeddings ``experts``
        (N, d_e), or the layer's own learned vector (``embeddings=local``)."""
        return experts.mean(dim=0) if self.local_embedding is None else self.local_embedding


class MaskedMLP(nn.Module):
    """A frozen dense MLP whose tokens each run one learned expert (Eq. 2-3), during training.

    After a forward pass while ``recording``: ``hard`` (tokens, N) one-hot decisions and ``soft`` their
    Gumbel-softmax probabilities, for the load-balancing loss (Eq. 9)."""

    def __init__(self, weights: MlpWeights, modules: LayerModules, tau: float, mask_noise: str = "gumbel",
                 layer: int = 0) -> None:
        super().__init__()
        self.weights, self.modules_, self.tau, self.layer = weights, modules, tau, layer
        self.embeddings: Tensor | None = None  # E_l, set before every step
        self.enabled = True
        self.noise: str | None = mask_noise  # None: the deterministic masks of the converted model
        self.recording = False
        self.hard: Tensor | None = None
        self.soft: Tensor | None = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not self.enabled:
            return self.weights.forward(hidden_states)
        # the learned modules stay in float32 whatever the model's dtype: cast in, and the masks back out
        x = hidden_states.to(self.embeddings.dtype)
        g, soft = st_gumbel_softmax(self.modules_.router(x), self.tau, self.noise is not None,
                                    ("router", self.layer))                                           # Eq. 3
        if self.recording:
            self.hard, self.soft = g.detach(), soft
        s = st_gumbel_sigmoid(self.modules_.proj_mlp(g @ self.embeddings), self.tau, self.noise,
                              ("mlp_mask", self.layer))                                              # s: Eq. 3
        w = self.weights
        return nn.functional.linear(w.hidden(hidden_states) * s.to(hidden_states.dtype), w.down, w.down_bias)  # Eq. 2


class AttentionMasks:
    """Hooks that mask a LLaMA-style attention's head dimension during training (Eq. 4-5).

    ``projections`` are the attention's q/k/v/o by role (``DecoderAdapter.attention_projections``), so
    the family's module names stay in ``arch``. ``tokens_kept`` holds, after a forward pass while
    ``recording``, s_t for every token (tokens, head_dim), for the union and parameter regularisers, and
    ``qk_kept`` s_0' (head_dim,); ``token_logits`` (detached) what the conversion thresholds. The masks the
    projections' hooks apply live for one attention forward pass."""

    def __init__(self, attn: nn.Module, projections: dict[str, nn.Linear], modules: LayerModules,
                 tau: float, mask_noise: str = "gumbel", layer: int = 0) -> None:
        self.modules_, self.tau, self.head_dim, self.layer = modules, tau, attn.head_dim, layer
        self.embedding: Tensor | None = None  # LayerModules.attention_embedding, set before every step
        self.enabled = True
        self.noise: str | None = mask_noise
        self.recording = False
        self.tokens_kept: Tensor | None = None
        self.token_logits: Tensor | None = None
        self.qk_kept: Tensor | None = None
        self.heads_kept: Tensor | None = None
        self._qk_masks: Tensor | None = None
        self._token_masks: Tensor | None = None
        self._head_masks: Tensor | None = None
        self._handles: list[RemovableHandle] = [attn.register_forward_pre_hook(self._masks, with_kwargs=True),
                                                attn.register_forward_hook(self._forget)]
        if modules.head_pruning:  # a pruned head adds nothing to the output: its output projection's input is 0
            self._groups = projections["q"].out_features // projections["k"].out_features
            self._handles.append(projections["o"].register_forward_pre_hook(
                lambda _m, args: (self._drop_heads(args[0]),)))
            return
        self._handles += [
            projections["q"].register_forward_hook(lambda _m, _i, out: self._apply(out, self._qk_masks)),
            projections["k"].register_forward_hook(lambda _m, _i, out: self._apply(out, self._qk_masks)),
            projections["v"].register_forward_hook(lambda _m, _i, out: self._apply(out, self._token_masks)),
            projections["o"].register_forward_pre_hook(lambda _m, args: (self._apply(args[0], self._token_masks),)),
        ]

    def _masks(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.enabled:
            return
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        m = self.modules_
        if m.head_pruning:  # one static mask over the key/value heads, drawn as s_0 is
            self._head_masks = st_gumbel_sigmoid(m.proj_heads(self.embedding), self.tau, self.noise,
                                                 ("head_mask", self.layer), per_window=False)
            if self.recording:
                self.heads_kept = self._head_masks
            return
        half = st_gumbel_sigmoid(m.proj_qk(self.embedding), self.tau, self.noise, ("qk_mask", self.layer),
                                 per_window=False)                                       # s_0: Eq. 5 at t = 0
        self._qk_masks = torch.cat([half, half])                                         # Appendix A.2
        if m.vo_routing:
            logits = m.proj_vo(m.proj_e(x.to(self.embedding.dtype)) + self.embedding)  # float32 modules
            self._token_masks = st_gumbel_sigmoid(logits, self.tau, self.noise, ("vo_mask", self.layer))  # s_t: Eq. 5
            tokens_kept = self._token_masks.reshape(-1, self.head_dim)
        else:  # one static V/O mask, as s_0 (Table 13's "w/o VO routing")
            logits = m.proj_vo(self.embedding)
            self._token_masks = st_gumbel_sigmoid(logits, self.tau, self.noise, ("vo_mask", self.layer),
                                                  per_window=False)
            tokens_kept = self._token_masks.expand(x.shape[:-1].numel(), -1)  # every token's width
        self.token_logits = logits.detach()  # what the conversion thresholds
        if self.recording:
            self.qk_kept, self.tokens_kept = self._qk_masks, tokens_kept

    def _forget(self, *_: object) -> None:
        """The pass's masks go with it (they hold its graph)."""
        self._qk_masks = self._token_masks = self._head_masks = None

    def _drop_heads(self, out: Tensor) -> Tensor:
        """The attention output (..., heads x head_dim) with each key/value head's query heads times its mask."""
        if not self.enabled:
            return out
        heads = out.view(*out.shape[:-1], -1, self.head_dim)
        mask = self._head_masks.repeat_interleave(self._groups).to(out.dtype)
        return (heads * mask[:, None]).view(out.shape)

    def _apply(self, out: Tensor, mask: Tensor) -> Tensor:
        if not self.enabled:
            return out
        heads = out.view(*out.shape[:-1], -1, self.head_dim)
        mask = mask if mask.dim() == 1 else mask.unsqueeze(-2)  # per token: the same mask on every head
        return (heads * mask.to(out.dtype)).view(out.shape)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
