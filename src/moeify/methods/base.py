"""What every method gets (a conversion context) and what it registers (a ``Method``).

The registry is read before anything heavy is imported: a command validates its options against a method's
config in a fraction of a second, before the seconds that importing torch and transformers' models take.
So this module, and every method's ``config.py`` and ``__init__.py``, import neither: a ``Method`` names its
code as ``Deferred`` functions, imported on their first call."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from transformers import PreTrainedConfig, PreTrainedModel

    from moeify.arch import DecoderAdapter
    from moeify.calibration.corpus import Corpus
    from moeify.calibration.data import TextSource
    from moeify.planning import MethodMemory, ModelShape
    from moeify.training.loop import Checkpointing


@dataclass(frozen=True)
class Deferred:
    """The function ``name`` of ``module``, imported when it is first called."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


@dataclass(frozen=True)
class ConversionContext:
    """The dense model to convert, and the shared inputs of every method: what a method reads, never writes
    (what it makes, it returns as a ``Conversion`` or an ``Analysis``).

    ``work_dir``: where a method may keep state across runs (training checkpoints), or None."""

    model: PreTrainedModel
    tokenizer: Any
    calib: Corpus
    seed: int
    device: torch.device
    progress: bool = True
    work_dir: Path | None = None

    @property
    def adapter(self) -> DecoderAdapter:
        from moeify.arch import DecoderAdapter

        return DecoderAdapter(self.model)

    def checkpointing(self, method: str, cfg: Any, seq_len: int, free: tuple[str, ...] = ()) -> Checkpointing | None:
        """Where a method's training keeps its checkpoints (``<work_dir>/<method>_checkpoints``; None without a
        work folder), with the fingerprint a resumed run must share: every option of ``cfg`` but ``free``
        (those that may change between a run and its resume) and ``resume`` / ``checkpoint_every``, the
        training window, the seed, the model and the training text."""
        if self.work_dir is None:
            return None
        from moeify.training.loop import Checkpointing

        keep = {k: v for k, v in vars(cfg).items() if k not in ("resume", "checkpoint_every", *free)}
        fingerprint = {"method": method, **keep, "seq_len": seq_len, "seed": self.seed,
                       "model": str(self.model.config.name_or_path), "train_text_sha256": self.calib.sha256}
        return Checkpointing(self.work_dir / f"{method}_checkpoints", fingerprint, resume=cfg.resume)


@dataclass(frozen=True)
class Conversion:
    """What a method's ``convert`` made: the MoE model (the context's model, its layers replaced in place, so
    that a model that fills memory is never held twice), the method-specific part of the record (statistics,
    training logs) and files to write next to the model (name -> bytes, e.g. PNG plots)."""

    model: PreTrainedModel
    details: dict[str, Any]
    artifacts: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Analysis:
    """What a method's ``analyze`` found on the converted model: the record's ``details.analysis`` and files."""

    details: dict[str, Any]
    artifacts: dict[str, bytes] = field(default_factory=dict)


BudgetMatcher = Callable[[float, "DecoderAdapter"], tuple[list[dict[str, Any]], str]]
RuntimeOption = Callable[["PreTrainedModel", Any], Callable[[], None]]
ModelAnalysis = Callable[["PreTrainedModel", "Tensor", "torch.device", bool],
                         tuple[dict[str, Any], dict[str, bytes]]]


@dataclass(frozen=True)
class Method:
    """A registered conversion method: its paper, its typed config and its conversion function.

    ``convert(ctx, config)`` turns ``ctx.model`` into an MoE model and returns it as a ``Conversion``.
    ``analyze(ctx, config, eval_sources, seq_len)``, if any, runs on the converted model (``ctx.model``)
    and the held-out evaluation texts after the common evaluation and returns an ``Analysis``; it never
    trains.

    ``refit(ctx, config)``, if any: after a recovery moved the weights of ``ctx.model``, set again what the
    method calibrated on the weights to hold its budget (TEAL's thresholds, DSMoE's matched tau), in place;
    returns the record's ``recovery.refit`` entry, or None where nothing needed it.

    ``match_budget(apr, adapter)``: option sets to try in order so that the conversion lands at the
    activated-parameter ratio ``apr``, and a line saying how (``moeify compare``); None when the method
    cannot be matched, ``unmatched`` saying why. ``runtime_options``: options of a converted model that
    are not router options (name -> setter(model, value) returning the function that undoes it).
    ``model_analysis(model, batches, device, progress)``: an analysis of a dense model on its own
    (``moeify analyze``): record entries and files. ``paper_ratio``: how the method's paper counts its
    activated ratio (a key of ``moe.accounting.PAPER_RATIOS``), recorded beside the APR. ``partitions_mlp``:
    the method's MoE layers split the dense MLP's neurons among the shared part and the experts, so every
    expert on with unit weight (``MoeMLP.forward_all_experts``) reproduces the dense MLP (before any
    training): the identity the method x family tests pin. ``memory(shape, config, dtype bytes)``: the
    method's part of the peak-memory estimate (``moeify.planning``); ``inference_copy``: whether its layers
    hold a packed copy of their experts at inference (``runtime.moe``: routed experts; not a static
    pruning). ``layer_by_layer``: ``convert`` touches the model only
    through ``calibration.stream`` (training-free, no fine-tune), so it converts a model loaded layer by
    layer (``moeify.offload``: larger than memory). ``keeps_attention(config)``: the conversion with ``config``
    leaves every attention projection a plain ``nn.Linear`` (neither pruned nor thresholded), so
    ``attention_sparsity`` can threshold it."""

    name: str
    paper: str
    summary: str
    config_cls: type
    convert: Callable[[ConversionContext, Any], Conversion]
    analyze: Callable[[ConversionContext, Any, list[TextSource], int], Analysis] | None = None
    refit: Callable[[ConversionContext, Any], dict[str, Any] | None] | None = None
    match_budget: BudgetMatcher | None = None
    unmatched: str = "it has no budget option"
    runtime_options: Mapping[str, RuntimeOption] = field(default_factory=dict)
    model_analysis: ModelAnalysis | None = None
    paper_ratio: str = "apr"
    partitions_mlp: bool = False
    memory: Callable[[ModelShape, Any, int], MethodMemory] = Deferred("moeify.planning", "method_memory")
    inference_copy: bool = True
    layer_by_layer: bool = False
    keeps_attention: Callable[[Any], bool] = field(default=lambda _config: True)

    def run(self, ctx: ConversionContext, config: Any) -> Conversion:
        """Convert ``ctx.model`` and give its MoE layers the model-wide packed widths, as a load of the
        saved folder does (``runtime.moe.set_packed_widths``).

        The converted model is in the working dtype (the dense model's): methods build routers and learn
        masks in float32, and what they made is cast back, so a bfloat16 model converts to a bfloat16 one.
        Buffers the model had before keep their dtype (rotary frequencies stay float32, as transformers
        keeps them)."""
        from moeify.offload import cast_new_state
        from moeify.runtime.moe import set_packed_widths

        dtype = next(ctx.model.parameters()).dtype
        kept = {name for name, _ in ctx.model.named_buffers()}
        conversion = self.convert(ctx, config)
        cast_new_state(conversion.model, dtype, kept)
        set_packed_widths(conversion.model)
        return conversion

    def check(self, config: Any, model_config: PreTrainedConfig) -> None:
        """Model-dependent validation (e.g. ``top_k`` against the expert count), before heavy work."""
        config.check(model_config)

