"""Export a converted model to a standard Hugging Face MoE architecture that serving engines load.

``EXPORTERS[name].supports(model, explain=True)`` says whether the format represents the conversion
exactly and, if not, every reason; ``build`` makes the target model with transformers' own config and
model classes (so transformers owns the checkpoint layout), copies attention, norms and embeddings by
name and the MoE layers from ``formats``, fills every tensor exactly once, and measures twice: every
MLP against the one it replaces in float64 (the exactness of the mapping) and the largest float32 logit
difference to the source (mapping plus kernel rounding); ``save_hf`` writes it with ``save_pretrained``.
The native format (``moeify.save``) stays the lossless default: these formats exist for vLLM and SGLang.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from moeify.arch import DecoderAdapter, UnsupportedFamilyError
from moeify.arch.standard_moe import DENSE_REFERENCE_KEY
from moeify.export.formats import FORMATS, Source, TargetFormat
from moeify.export.hf_parts import (
    EXACT,
    Approximation,
    LayerParts,
    NotRepresentable,
    grouped_reasons,
    layer_parts,
    padded_attention,
    thresholds_reason,
)
from moeify.files import atomic_dir
from moeify.moe.accounting import dense_reference
from moeify.runtime.attention import PrunedAttention
from moeify.runtime.packed import GROUPED_MM_DTYPES
from moeify.runtime.sparse_inputs import ThresholdedLinear

EXPORT_RECORD = "moeify_export.json"
PROBE_SHAPE = (2, 64)  # random token ids the source and the export are compared on
EXACT_TOLERANCE = 1e-4  # relative to the largest |logit|; fp32 exports land near 1e-6
MAPPING_TOLERANCE = 1e-9  # float64 MLP outputs, relative to their largest magnitude; exact mappings: ~1e-16
MLP_PROBE_TOKENS = 64  # random hidden states each MLP pair is compared on


class NotExportable(ValueError):
    """The model cannot be written in the requested format; the message lists every reason."""


@dataclass(frozen=True)
class Support:
    """Whether a format represents a model; ``bool(support)`` is the answer, ``reasons`` say why not.
    ``approximable``: every reason is a part that ``--approximate`` would replace by its closest form."""

    format: str
    reasons: tuple[str, ...] = ()
    approximable: bool = False

    def __bool__(self) -> bool:
        return not self.reasons

    def __str__(self) -> str:
        if not self.reasons:
            return f"{self.format}: represents the model exactly"
        return f"{self.format} cannot represent this model:\n" + "\n".join(f"  - {r}" for r in self.reasons)


@dataclass
class HfExport:
    """The model in a standard format, in memory, and what is known about its fidelity."""

    model: PreTrainedModel
    format: str
    record: dict[str, Any] = field(default_factory=dict)


def _sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window when it is shorter than the context (Mistral, Qwen2 with sliding layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window if window is not None and window < config.max_position_embeddings else None


def _source(model: PreTrainedModel, approximation: Approximation
            ) -> tuple[Source, dict[str, torch.Tensor], list[NotRepresentable]]:
    """The non-MLP tensors of ``model`` (attention, norms, embeddings) and why no format takes them."""
    adapter = DecoderAdapter(model)
    mlp_prefixes = tuple(adapter.mlp_path(i) + "." for i in range(adapter.num_layers))
    tensors = {k: v for k, v in model.state_dict().items() if not k.startswith(mlp_prefixes)}
    errors = []
    for name, attn in ((n, m) for n, m in model.named_modules() if isinstance(m, PrunedAttention)):
        for key in [k for k in tensors if k.startswith(f"{name}.router.")] + [f"{name}.qk_index", f"{name}.vo_index"]:
            tensors.pop(key, None)  # index buffers, and a per-token router the static dimensions replace
        try:
            tensors.update(padded_attention(f"{name}.", attn, approximation.attention_dims.get(name)))
        except NotRepresentable as error:
            errors.append(error)
            break
    thresholded = [name.removesuffix("weight") + "threshold" for name in tensors if name.endswith(".weight")
                   and isinstance(model.get_submodule(name.removesuffix(".weight")), ThresholdedLinear)]
    if thresholded and (reason := thresholds_reason(model, approximation)) is not None:
        errors.append(reason.at("attention"))
    for name in thresholded:
        tensors.pop(name)
    reasons = list(adapter.family.unexportable)
    if adapter.uses_parallel_residual():
        reasons.append("attention and MLP read the same input (parallel residual); the formats chain them")
    if (window := _sliding_window(model.config)) is not None:
        reasons.append(f"attention uses a sliding window of {window} tokens (< the context "
                       f"{model.config.max_position_embeddings}); the formats attend to the whole context")
    return Source(model.config, frozenset(tensors)), tensors, errors + [NotRepresentable(r) for r in reasons]


def _target_mlp_prefixes(fmt: TargetFormat, config: PretrainedConfig) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.{name}." for i in range(config.num_hidden_layers) for name in fmt.mlp_modules)


def _layout_reasons(fmt: TargetFormat, source: Source, config: PretrainedConfig,
                    tensors: dict[str, torch.Tensor]) -> list[str]:
    """Compare the source's non-MLP tensors with the target's, by name and shape (a meta-device model:
    no memory). A name the target lacks means the source computes something the format cannot
    (an o_proj bias, a fused qkv projection, LayerNorm biases)."""
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config).state_dict()
    target = {k: v for k, v in target.items() if not k.startswith(_target_mlp_prefixes(fmt, config))}
    extra = sorted(set(source.keys) - set(target))
    lacking = sorted(k for k in set(target) - set(source.keys) if not k.endswith(fmt.zero_filled))
    reasons = []
    if extra:
        reasons.append(f"{len(extra)} source tensors have no place in {fmt.name} (e.g. {', '.join(extra[:3])}): "
                       "its attention, norms or embeddings differ from the source family's")
    if lacking:
        reasons.append(f"{fmt.name} needs tensors the source lacks (e.g. {', '.join(lacking[:3])})")
    shapes = [k for k in set(target) & set(source.keys) if tuple(target[k].shape) != tuple(tensors[k].shape)]
    if shapes:
        reasons.append(f"shapes differ for {', '.join(sorted(shapes)[:3])}")
    return reasons


@dataclass(frozen=True)
class _Analysis:
    """What ``supports`` decides and ``build`` reuses: the layers, the non-MLP tensors, the target config."""

    support: Support
    parts: list[LayerParts] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    config: PretrainedConfig | None = None
    source: Source | None = None


class HfExporter:
    """One standard format: ``supports`` (with reasons), ``build`` (the target model in memory)."""

    def __init__(self, fmt: TargetFormat) -> None:
        self.format = fmt

    @property
    def name(self) -> str:
        return self.format.name

    def _analyse(self, model: PreTrainedModel, approximation: Approximation) -> _Analysis:
        try:
            source, tensors, source_errors = _source(model, approximation)
        except UnsupportedFamilyError as error:
            return _Analysis(Support(self.name, (str(error),)))
        parts, layer_errors = layer_parts(model, approximation)
        errors = source_errors + layer_errors
        # Only approximable parts stand in the way (so far: the format's own checks run once every layer is known).
        approximable = bool(errors) and all(e.approximable for e in errors)
        reasons = grouped_reasons(errors)
        if not layer_errors:
            reasons += self.format.explain(parts, source)
        config = None
        if not reasons:
            config = self.format.config(parts, source)
            reasons += _layout_reasons(self.format, source, config, tensors)
        return _Analysis(Support(self.name, tuple(reasons), approximable), parts, tensors, config, source)

    def supports(self, model: PreTrainedModel, *, explain: bool = False,
                 approximation: Approximation = EXACT) -> bool | Support:
        """Whether this format represents ``model`` (with ``approximation`` in place of what it names); with
        ``explain=True`` a ``Support`` whose ``reasons`` say precisely why not."""
        support = self._analyse(model, approximation).support
        return support if explain else bool(support)

    def neurons_per_token(self, model: PreTrainedModel, approximation: Approximation = EXACT) -> int | None:
        """MLP neurons a token runs through in this format's layout of ``model`` (zero padding included), with
        ``approximation`` in place of what it names, or None where the format does not hold that exactly."""
        analysis = self._analyse(model, approximation)
        return self.format.neurons_per_token(analysis.config) if analysis.support else None

    def cheapest_dense_layers(self, model: PreTrainedModel, approximation: Approximation = EXACT) -> list[int]:
        """The routed layers (unit expert weights) whose dense form (``hf_parts.dense_form``) makes this
        format's layout run the fewest MLP neurons per token, fewest layers on a tie; [] when none helps.

        The formats size experts and shared parts once for all layers, so one layer that keeps most of its
        neurons pads every other layer to its width; formats with dense layers of their own width
        (qwen2_moe's ``mlp_only_layers``, glm4_moe's leading ones) can hold it apart. The layers are taken
        widest first, by each of three widths (shared + expert, shared, expert): a layer sets the padded
        widths through one of them."""
        analysis = self._analyse(model, approximation)
        if not analysis.support:
            raise NotExportable(str(analysis.support))
        parts = analysis.parts
        units = [p.index for p in parts if p.routed and p.routing.weighting == "unit" and not p.routing.approximate]
        dense, _ = layer_parts(model, replace(approximation, dense_layers=frozenset(units)))
        by_index = {p.index: p for p in dense if p.index in units}  # those with a dense form (unit scale too)

        def cost(layers: frozenset[int]) -> float:  # inf: a layout the format cannot hold (nothing routed)
            mixed = [by_index[p.index] if p.index in layers else p for p in parts]
            if self.format.explain(mixed, analysis.source):
                return math.inf
            return self.format.neurons_per_token(self.format.config(mixed, analysis.source))

        def widths(p: LayerParts) -> tuple[int, int]:
            return p.shared.width, max(e.width for e in p.experts)

        best, best_cost = frozenset(), cost(frozenset())
        for key in (lambda p: sum(widths(p)), lambda p: widths(p)[0], lambda p: widths(p)[1]):
            order = [p.index for p in sorted((p for p in parts if p.index in by_index), key=key, reverse=True)]
            for n in range(1, len(order) + 1):
                layers = frozenset(order[:n])
                if (neurons := cost(layers), n) < (best_cost, len(best)):
                    best, best_cost = layers, neurons
        return sorted(best)

    @torch.no_grad()
    def build(self, model: PreTrainedModel, *, approximation: Approximation = EXACT) -> HfExport:
        """The model in this format, built by transformers from its own config; raises ``NotExportable``."""
        analysis = self._analyse(model, approximation)
        if not analysis.support:
            raise NotExportable(str(analysis.support))
        parts, config = analysis.parts, analysis.config
        setattr(config, DENSE_REFERENCE_KEY, dense_reference(model))  # APR's denominator for `moeify eval`
        dtype = next(model.parameters()).dtype
        # grouped_mm (transformers' default experts kernel) has no float64; eager computes the same function
        kernel = {} if dtype in GROUPED_MM_DTYPES else {"experts_implementation": "eager"}
        with no_init_weights():  # every tensor is overwritten below, and checked to be
            target = AutoModelForCausalLM.from_config(config, dtype=dtype, **kernel)
        target.tie_weights()  # part of the initialisation skipped above: a tied config's head is the embedding
        state = target.state_dict()
        written = set()
        for key, value in {**analysis.tensors, **self.format.tensors(parts, config)}.items():
            state[key].copy_(value)
            written.add(key)
        for key in set(state) - written:
            if key.endswith(self.format.zero_filled):
                state[key].zero_()
                written.add(key)
        if unwritten := sorted(set(state) - written):
            raise RuntimeError(f"internal error: {self.name} tensors left unwritten: {', '.join(unwritten[:5])}")
        target = target.to(next(model.parameters()).device).eval()
        approximate = bool(approximation)
        attention = _compare_attention(model, target)  # padded head dimensions: proven in float64 instead
        record = {"format": self.name, "exact": not approximate, **attention,
                  "rearranged_layers": self.format.rearranged(parts, config),
                  **_compare(model, target, approximate or bool(attention["padded_attention_layers"])),
                  **_compare_mlps(model, target, parts, approximate, self.format),
                  "layers": [p.record() for p in parts],
                  "params": {"source": _count(model), "export": _count(target)},
                  "mlp_neurons_per_token": {"source": float(sum(p.neurons_per_token for p in parts)),
                                            "export": self.format.neurons_per_token(config)}}
        return HfExport(target, self.name, record)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _compare(source: PreTrainedModel, target: PreTrainedModel, approximate: bool) -> dict[str, Any]:
    """Largest |logit difference| on random token ids; an exact export that misses the tolerance is a bug
    (or a family difference the name checks missed), so it fails rather than being written."""
    device = next(source.parameters()).device
    length = min(PROBE_SHAPE[1], source.config.max_position_embeddings)
    ids = torch.randint(0, source.config.vocab_size, (PROBE_SHAPE[0], length),
                        generator=torch.Generator().manual_seed(0)).to(device)
    expected = source(input_ids=ids, use_cache=False).logits.float()
    diff = float((target(input_ids=ids, use_cache=False).logits.float() - expected).abs().max())
    bound = EXACT_TOLERANCE * max(1.0, float(expected.abs().max()))
    if not approximate and expected.dtype == torch.float32 and next(source.parameters()).dtype == torch.float32 \
            and diff > bound:
        raise RuntimeError(f"the {target.config.model_type} export differs from the source by {diff:.3g} in the "
                           f"logits (allowed {bound:.3g}); not written — please report this model")
    return {"max_abs_logit_diff": diff, "probe": f"{PROBE_SHAPE[0]}x{length} random token ids (seed 0)"}


def _compare_attention(source: PreTrainedModel, target: PreTrainedModel) -> dict[str, Any]:
    """Largest |difference| between each statically pruned attention and its zero-padded export, both in
    float64 on the same random hidden states (with the rotary cos/sin the source passes its first pruned
    attention on a probe): the mapping itself. The padded products sum in another order, which on a deep
    model moves float32 logits beyond the bound ``_compare`` holds exact exports to, so these layers are
    proven here. Above ``MAPPING_TOLERANCE`` is a bug: not written."""
    layers = [(name, m) for name, m in source.named_modules() if isinstance(m, PrunedAttention) and m.router is None]
    if not layers:
        return {"padded_attention_layers": []}
    device = next(source.parameters()).device
    rotary: dict[str, tuple[torch.Tensor, ...]] = {}

    def grab(_module: nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        rotary.setdefault("cos_sin", kwargs["position_embeddings"])

    handle = layers[0][1].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        source(input_ids=torch.zeros(1, MLP_PROBE_TOKENS, dtype=torch.long, device=device), use_cache=False)
    finally:
        handle.remove()
    cos, sin = (t.double() for t in rotary["cos_sin"])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, MLP_PROBE_TOKENS, source.config.hidden_size, generator=generator, dtype=torch.float64)
    x = x.to(device)
    gap, scale = 0.0, 0.0
    for name, module in layers:
        mine, theirs = copy.deepcopy(module).double(), copy.deepcopy(target.get_submodule(name)).double()
        expected = mine(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        got = theirs(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        gap, scale = max(gap, float((got - expected).abs().max())), max(scale, float(expected.abs().max()))
    if gap > MAPPING_TOLERANCE * max(1.0, scale):
        raise RuntimeError(f"an attention of the {target.config.model_type} export differs from the source's by "
                           f"{gap:.3g} in float64; not written — please report this model")
    return {"padded_attention_layers": [name for name, _ in layers], "max_abs_attention_diff_float64": gap}


def _compare_mlps(source: PreTrainedModel, target: PreTrainedModel, parts: list[LayerParts],
                  approximate: bool, fmt: TargetFormat) -> dict[str, Any]:
    """Largest |difference| between each source MLP and the export's MLP in its place, both copied to
    float64 and run on the same random hidden states (scaled by the MLP's input norm weight, as after the
    norm): the mapping itself, free of the float32 kernels' rounding that the logit difference also holds
    (one ulp in a first layer can grow to 1e-5 in a small model's logits). Routing stays the model's
    (cosine prototypes score in float32 by design), so a near-tie may differ; it never did in our tests.
    An exact export above ``MAPPING_TOLERANCE`` is a bug: it fails rather than being written."""
    adapter = DecoderAdapter(source)
    device = next(source.parameters()).device
    generator = torch.Generator().manual_seed(0)
    gap, scale = 0.0, 0.0
    for part in parts:
        mine = copy.deepcopy(adapter.mlp_module(part.index)).double()
        layer = target.get_submodule(f"model.layers.{part.index}")
        theirs = [copy.deepcopy(m).double() for name in fmt.mlp_modules if (m := getattr(layer, name)) is not None]
        for module in (m for block in theirs for m in block.modules()):
            if getattr(module, "config", None) is not None:  # grouped_mm has no float64 kernel; eager: the same
                module.config._experts_implementation = "eager"
        gamma, _ = adapter.mlp_norm_affine(part.index)
        x = torch.randn(1, MLP_PROBE_TOKENS, part.shared.up.shape[1], generator=generator, dtype=torch.float64)
        x = (x * gamma.double().cpu()).to(device)
        expected = mine(x)
        got = sum(out[0] if isinstance(out, tuple) else out for out in (block(x) for block in theirs))
        gap, scale = max(gap, float((got - expected).abs().max())), max(scale, float(expected.abs().max()))
    if not approximate and gap > MAPPING_TOLERANCE * max(1.0, scale):
        raise RuntimeError(f"an MLP of the {target.config.model_type} export differs from the source's by {gap:.3g} "
                           "in float64; not written — please report this model")
    return {"max_abs_mlp_diff_float64": gap}


def _legacy_rope_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta``/``rope_scaling`` (and ``partial_rotary_factor``) next to ``rope_parameters``, for
    loaders older than transformers 5 (and vLLM versions that read them)."""
    rope = dict(config.get("rope_parameters") or {})
    legacy: dict[str, Any] = {"rope_theta": rope.get("rope_theta", 10000.0)}
    kind = rope.get("rope_type", "default")
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    legacy["rope_scaling"] = None if kind == "default" else {**scaling, "type": kind}
    if "partial_rotary_factor" in rope:
        legacy["partial_rotary_factor"] = rope["partial_rotary_factor"]
    return legacy


def save_hf(export: HfExport, out: str | Path, tokenizer: Any = None, *, overwrite: bool = False,
            record: dict[str, Any] | None = None) -> Path:
    """Write ``export`` atomically: transformers' ``save_pretrained`` (its original checkpoint layout,
    per-expert tensors), the tokenizer, legacy rope keys and ``moeify_export.json``."""
    out = Path(out)
    with atomic_dir(out, overwrite=overwrite, command="export") as tmp:
        export.model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config.update(_legacy_rope_keys(config))
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / EXPORT_RECORD).write_text(json.dumps({**export.record, **(record or {})}, indent=2, default=str) + "\n")
    return out


EXPORTERS: dict[str, HfExporter] = {name: HfExporter(fmt) for name, fmt in FORMATS.items()}
