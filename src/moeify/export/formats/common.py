"""What every standard Hugging Face format moeify writes shares (``formats/<name>.py`` each hold one format, as
data plus functions).

A format says why it cannot represent a model (``explain``), builds transformers' own config for it
(``config``) and the tensors of every MLP slot under the names of transformers' in-memory modules
(``tensors``); ``hf_export`` instantiates transformers' model class from that config, copies attention,
norms and embeddings by name, and lets ``save_pretrained`` write the checkpoint layout engines read.

How each format represents a conversion exactly (routing must be linear and, except qwen2_moe's
softmax case, unit-weight top-1; every expert is zero-padded to one aligned width W and the shared part
to an aligned S: ``runtime.moe.packed_widths``, the widths the native runtime computes with, so a block
that holds a layer at those widths computes the native layer's float32 sums in the same order); each format's
module says how it holds shared parts, dense layers and routing weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PretrainedConfig

from moeify.export.hf_parts import GatedMlp, LayerParts

SIGMOID_SCORE_BOUND = 2.0  # |router score| kept below this: sigmoid stays strictly increasing in fp32


@dataclass(frozen=True)
class Source:
    """What a format needs from the source model beyond its MLPs: the config and the names of the
    tensors outside the MLP slots (attention, norms, embeddings)."""

    config: PretrainedConfig
    keys: frozenset[str]

    def has(self, suffix: str) -> bool:
        return any(key.endswith(suffix) for key in self.keys)

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def rotary_fraction(self) -> float:
        rope = getattr(self.config, "rope_parameters", None) or {}
        return float(rope.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", None) or 1.0))

    def base_fields(self) -> dict[str, Any]:
        """Config fields every target shares with a LLaMA-style source, copied as they are."""
        cfg = self.config
        fields = {name: getattr(cfg, name) for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range", "attention_dropout",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")}
        rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        return {**fields, "head_dim": self.head_dim, "rope_parameters": rope}


class TargetFormat(Protocol):
    name: str
    ties_embeddings: bool        # whether engines honour tie_word_embeddings for this architecture
    zero_filled: tuple[str, ...]  # target tensors the source may lack, written as zeros (exact)
    mlp_modules: tuple[str, ...]  # the decoder layer's modules that hold its MLP (their outputs add up)

    def explain(self, parts: list[LayerParts], source: Source) -> list[str]: ...

    def config(self, parts: list[LayerParts], source: Source) -> PretrainedConfig: ...

    def tensors(self, parts: list[LayerParts], config: PretrainedConfig) -> dict[str, Tensor]: ...

    def neurons_per_token(self, config: PretrainedConfig) -> int:
        """MLP neurons a token runs through the whole model in this layout, zero padding included: what the
        format's widths cost (``HfExporter.cheapest_dense_layers`` compares layouts by it)."""
        ...

    def rearranged(self, parts: list[LayerParts], config: PretrainedConfig) -> list[int]:
        """Layers whose MLP the format holds in another arrangement or width than moeify's runtime computes
        it (a shared part or a dense MLP folded into the experts, a wider shared part): the same function,
        other float32 sums. Every other layer's block computes the native layer's sums in the same order."""
        ...


def routing_reasons(parts: list[LayerParts], softmax_ok: bool, renormalised_ok: bool = False,
                    sigmoid_ok: bool = False) -> list[str]:
    """Why the routers of ``parts`` do not fit one global router setting of a format."""
    routed = [p for p in parts if p.routed]
    if not routed:
        return ["no layer is routed (the model is dense); there is no MoE to export"]
    kinds = {(p.routing.weighting, p.routing.top_k) for p in routed}
    if len(kinds) > 1:
        return [f"layers route differently ({sorted(kinds)}); a format has one router setting for all layers"]
    (weighting, top_k), = kinds
    if weighting == "unit" and top_k != 1:
        return [f"{top_k} experts per token each with weight 1: the formats' weights are router scores "
                "(renormalised or not), exactly 1 only for top-1; for a non-linear router (CMoE) --approximate "
                "fits routers whose renormalised weights are 1 within 1e-3 (qwen2_moe, granitemoeshared)"]
    if weighting == "softmax" and not softmax_ok:
        return ["softmax-probability expert weights (not renormalised) are qwen2_moe's norm_topk_prob=False only"]
    if weighting == "renormalised" and not renormalised_ok:
        return ["top-k weights renormalised over the chosen experts, beside an always-on part: qwen2_moe's "
                "norm_topk_prob=True and granitemoeshared only"]
    if weighting == "sigmoid" and not sigmoid_ok:
        return ["sigmoid-gate expert weights (not renormalised) are glm4_moe's norm_topk_prob=False only"]
    if weighting in ("softmax", "renormalised", "sigmoid") and len({len(p.experts) for p in routed}) > 1:
        return [f"with {weighting} weights every routed layer needs the same number of experts "
                "(a padding expert would change the probabilities)"]
    return []


def full_rotary_reasons(source: Source, name: str) -> list[str]:
    if source.rotary_fraction != 1.0:
        return [f"rotary embedding covers {source.rotary_fraction} of each head; {name} rotates whole heads"]
    return []


def mlp_tensors(prefix: str, mlp: GatedMlp) -> dict[str, Tensor]:
    return {f"{prefix}gate_proj.weight": mlp.gate, f"{prefix}up_proj.weight": mlp.up,
            f"{prefix}down_proj.weight": mlp.down}


def routed_tensors(prefix: str, experts: list[GatedMlp], width: int, router: Tensor,
                   router_name: str = "gate") -> dict[str, Tensor]:
    """Experts stacked as transformers 5 holds them: gate_up_proj (E, 2 width, d) with gate rows first
    (``.chunk(2)`` gives gate, up), down_proj (E, d, width); the router weight (E, d)."""
    padded = [e.padded(width) for e in experts]
    return {f"{prefix}experts.gate_up_proj": torch.stack([torch.cat([e.gate, e.up]) for e in padded]),
            f"{prefix}experts.down_proj": torch.stack([e.down for e in padded]),
            f"{prefix}{router_name}.weight": router}


def max_width(values: list[int], default: int = 0) -> int:
    return max(values, default=default)
