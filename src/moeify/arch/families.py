"""Where each supported model family keeps its decoder layers, MLPs and attention projections.

This module and ``adapter.py`` are the only places in moeify that know Hugging Face module names.
Every family is one frozen ``FamilySpec`` value (data, not a subclass), so adding a family means adding
one entry to ``FAMILIES`` after checking the names in ``transformers/models/<family>/modeling_<family>.py``.

The three MLP layouts found in the supported families:

* ``"gated"``: separate ``gate``/``up``/``down`` linears, ``down(act(gate(x)) * up(x))`` (LLaMA, Mistral, Qwen2/3,
  Gemma-3).
* ``"fused_gated"``: one ``gate_up`` linear whose output ``chunk(2, -1)`` is ``(gate, up)`` in that order,
  then ``down`` (Phi-3).
* ``"plain"``: two layers, ``down(act(up(x)))`` (GPT-NeoX ``dense_h_to_4h``/``dense_4h_to_h``, Phi ``fc1``/``fc2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MlpKind = Literal["gated", "fused_gated", "plain"]


NATIVE_PREFIX = "moeify_"  # a native folder's model_type: the prefix, then the base family's


class UnsupportedFamilyError(ValueError):
    """The model's ``config.model_type`` is not one moeify knows how to take apart."""


@dataclass(frozen=True)
class FamilySpec:
    """Module names of one decoder-only family, relative to the model root / a decoder layer / its MLP.

    ``attn_projections`` maps a role to the attribute of the attention module: roles are ``q``, ``k``,
    ``v``, ``o`` for separate projections, or ``qkv`` + ``o`` when the input projections are fused.
    It is a tuple of pairs (not a dict) so the spec stays hashable.
    """

    name: str
    model_types: tuple[str, ...]
    layers_path: str
    mlp_attr: str
    attn_attr: str
    mlp_norm_attr: str | None  # None: the MLP reads the residual stream unnormed (OLMo-2)
    mlp_kind: MlpKind
    down_proj: str
    up_proj: str | None = None
    gate_proj: str | None = None
    gate_up_proj: str | None = None
    act_attr: str = "act_fn"
    act_config_key: str = "hidden_act"
    attn_projections: tuple[tuple[str, str], ...] = (
        ("q", "q_proj"),
        ("k", "k_proj"),
        ("v", "v_proj"),
        ("o", "o_proj"),
    )
    # Informational: attention and MLP read the same residual stream (their outputs are added together)
    # instead of the MLP reading the attention output. ``parallel_residual_key`` names a config flag that
    # decides it per model (GPT-NeoX); ``parallel_residual`` is the answer when there is no such flag.
    parallel_residual: bool = False
    parallel_residual_key: str | None = None
    # RMSNorm computing x * (norm_weight_offset + w) (Gemma: 1): every reader of a norm's gamma goes
    # through ``DecoderAdapter.mlp_norm_affine``, which adds it.
    norm_weight_offset: float = 0.0
    # What the standard MoE export formats cannot represent in this family (``--check`` lists it).
    unexportable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Catch an inconsistent spec at import time rather than as an AttributeError deep in a conversion.
        need = {"gated": ("up_proj", "gate_proj"), "fused_gated": ("gate_up_proj",), "plain": ("up_proj",)}
        forbid = {
            "gated": ("gate_up_proj",),
            "fused_gated": ("up_proj", "gate_proj"),
            "plain": ("gate_proj", "gate_up_proj"),
        }
        if self.mlp_kind not in need:
            raise ValueError(f"{self.name}: unknown mlp_kind {self.mlp_kind!r}")
        for field in need[self.mlp_kind]:
            if getattr(self, field) is None:
                raise ValueError(f"{self.name}: a {self.mlp_kind} MLP needs {field}")
        for field in forbid[self.mlp_kind]:
            if getattr(self, field) is not None:
                raise ValueError(f"{self.name}: a {self.mlp_kind} MLP has no {field}")
        roles = [role for role, _ in self.attn_projections]
        if sorted(roles) not in (["k", "o", "q", "v"], ["o", "qkv"]):
            raise ValueError(f"{self.name}: attention roles must be q/k/v/o or qkv/o, got {roles}")

    @property
    def gated(self) -> bool:
        return self.mlp_kind != "plain"

    @property
    def mlp_linear_attrs(self) -> tuple[str, ...]:
        """The attributes of a dense MLP of this family that must be ``nn.Linear``."""
        names = (self.gate_up_proj, self.gate_proj, self.up_proj, self.down_proj)
        return tuple(n for n in names if n is not None)

    def uses_parallel_residual(self, config: PretrainedConfig) -> bool:
        """Whether attention and MLP of this model read the same layer input (see the field comment)."""
        if self.parallel_residual_key is not None:
            return bool(getattr(config, self.parallel_residual_key, self.parallel_residual))
        return self.parallel_residual


_LLAMA_LIKE = dict(
    layers_path="model.layers",
    mlp_attr="mlp",
    attn_attr="self_attn",
    mlp_norm_attr="post_attention_layernorm",
    mlp_kind="gated",
    gate_proj="gate_proj",
    up_proj="up_proj",
    down_proj="down_proj",
    act_attr="act_fn",
)

_GEMMA_UNEXPORTABLE = (
    "the MLP output has a norm of its own (post_feedforward_layernorm) and the attention one too "
    "(post_attention_layernorm); the formats add both to the residual unnormed",
    "embeddings are scaled by sqrt(hidden_size); the formats do not scale them",
)

FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(name="llama", model_types=("llama",), **_LLAMA_LIKE),
    FamilySpec(name="mistral", model_types=("mistral",), **_LLAMA_LIKE),
    FamilySpec(name="qwen2", model_types=("qwen2",), **_LLAMA_LIKE),
    FamilySpec(name="qwen3", model_types=("qwen3",), **_LLAMA_LIKE),
    FamilySpec(
        name="gemma3",
        model_types=("gemma3_text",),
        **{**_LLAMA_LIKE, "mlp_norm_attr": "pre_feedforward_layernorm"},  # MLP norms before and after
        act_config_key="hidden_activation",  # GeGLU with the tanh approximation
        norm_weight_offset=1.0,
        unexportable=_GEMMA_UNEXPORTABLE,
    ),
    FamilySpec(
        name="gemma2",
        model_types=("gemma2",),
        **{**_LLAMA_LIKE, "mlp_norm_attr": "pre_feedforward_layernorm"},
        act_config_key="hidden_activation",
        norm_weight_offset=1.0,
        unexportable=_GEMMA_UNEXPORTABLE + ("attention scores and logits are soft-capped; the formats do not cap",),
    ),
    FamilySpec(
        name="olmo2",
        model_types=("olmo2",),
        **{**_LLAMA_LIKE, "mlp_norm_attr": None},  # post-norm: the norms act on the attention/MLP outputs
        unexportable=("the attention and MLP outputs are normalised before the residual add (post-norm); the "
                      "formats normalise their inputs",),
    ),
    FamilySpec(
        name="granite",
        model_types=("granite",),
        **_LLAMA_LIKE,
        unexportable=("embeddings, attention scores, residual branches and logits are scaled by the config's "
                      "multipliers; the formats have no such factors",),
    ),
    FamilySpec(
        name="phi3",
        model_types=("phi3",),
        layers_path="model.layers",
        mlp_attr="mlp",
        attn_attr="self_attn",
        mlp_norm_attr="post_attention_layernorm",
        mlp_kind="fused_gated",
        gate_up_proj="gate_up_proj",
        down_proj="down_proj",
        act_attr="activation_fn",
        attn_projections=(("qkv", "qkv_proj"), ("o", "o_proj")),
    ),
    FamilySpec(
        name="gpt_neox",
        model_types=("gpt_neox",),
        layers_path="gpt_neox.layers",
        mlp_attr="mlp",
        attn_attr="attention",
        mlp_norm_attr="post_attention_layernorm",
        mlp_kind="plain",
        up_proj="dense_h_to_4h",
        down_proj="dense_4h_to_h",
        act_attr="act",
        attn_projections=(("qkv", "query_key_value"), ("o", "dense")),
        parallel_residual=True,
        parallel_residual_key="use_parallel_residual",
    ),
    FamilySpec(
        name="phi",
        model_types=("phi",),
        layers_path="model.layers",
        mlp_attr="mlp",
        attn_attr="self_attn",
        # Phi has a single norm per layer; attention and MLP both read its output.
        mlp_norm_attr="input_layernorm",
        mlp_kind="plain",
        up_proj="fc1",
        down_proj="fc2",
        act_attr="activation_fn",
        attn_projections=(("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "dense")),
        parallel_residual=True,
    ),
)


def supported_model_types() -> tuple[str, ...]:
    """Every ``config.model_type`` covered by ``FAMILIES``, in declaration order."""
    return tuple(mt for fam in FAMILIES for mt in fam.model_types)


def family_for(config: PretrainedConfig) -> FamilySpec:
    """The spec covering ``config.model_type``; ``UnsupportedFamilyError`` names the supported ones. A
    folder moeify saved, loaded through its copied code (``trust_remote_code``), runs with classes moeify
    cannot inspect: the error says to load it with ``moeify.load``."""
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type.startswith(NATIVE_PREFIX):
        raise UnsupportedFamilyError(
            f"model_type {model_type!r} is a model moeify converted, loaded through its own copied code "
            "(trust_remote_code); moeify reads it loaded with moeify.load(path), which gives moeify's classes")
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    raise UnsupportedFamilyError(
        f"unsupported model_type {model_type!r}; moeify supports: {', '.join(supported_model_types())}"
    )
