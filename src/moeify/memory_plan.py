"""The memory plan of converting a model named as a user names it (``moeify plan``, ``moeify.plan``), and the
check ``convert`` makes with it before loading anything; ``planning`` holds the estimate itself.

Outside the ``api`` package, whose import brings in every use case: a checkpoint folder is planned without
importing torch (``ModelShape.from_checkpoint``), so ``moeify plan`` answers at once; other models have
their config read by transformers."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeify.dtypes import DTYPE_BYTES, dtype_name, working_dtype_name
from moeify.methods import AttentionSparsityOptions, Method, attention_memory, method_configs
from moeify.options import OptionError
from moeify.planning import (
    FROZEN_IN_FLOAT32,
    GIB,
    PRESETS,
    MemoryPlan,
    MethodMemory,
    ModelShape,
    plan_memory,
    preset_shape,
)
from moeify.sources import EMBEDDED_MODEL, model_source
from moeify.training.recovery_options import RecoveryOptions

if TYPE_CHECKING:
    import torch


def model_shape(model: str | Path | None) -> ModelShape:
    """A preset's shape (``moeify.planning.PRESETS``: llama-2-7b, ...) or that of a checkpoint: read from its
    folder's files where they tell, else from the config transformers reads (GGUF, hub, converted)."""
    if model is not None and str(model) in PRESETS:
        return preset_shape(str(model))
    name, source = str(model or EMBEDDED_MODEL), model_source(model)
    if source.gguf_file is None and Path(source.path).is_dir():
        shape = ModelShape.from_checkpoint(Path(source.path), name)
        if shape is not None:
            return shape
    from moeify.loading import load_config

    return ModelShape.from_config(load_config(model), name)


def plan(model: str | Path | None, method: str, options: dict[str, Any] | None = None, *,
         dtype: str | torch.dtype | None = None, eval_seq_len: int | None = None, device: str = "cpu",
         layer_by_layer: bool = False, eval_tokens: int | None = None, shards: int = 1) -> MemoryPlan:
    """The memory plan of converting ``model`` (a path, a hub name, a GGUF file or a preset) with ``method``
    on ``device``; ``dtype`` defaults to the checkpoint's own (a preset's: bfloat16). ``layer_by_layer``: held
    a decoder layer at a time, evaluated on ``eval_tokens`` positions (default: one batch of windows);
    ``shards``: per process of a training sharded over that many (``convert --fsdp`` under torchrun)."""
    spec, config, recovery, attention = method_configs(method, options)
    shape = model_shape(model)
    default = "bfloat16" if str(model) in PRESETS else None
    work_dtype = working_dtype_name(dtype, shape.config) if dtype is not None or default is None else default
    gguf = model is not None and str(model) not in PRESETS and model_source(model).gguf_file is not None
    return method_plan(shape, spec, config, work_dtype, eval_seq_len or shape.context, device, gguf,
                       layer_by_layer, eval_tokens, shards, recovery, attention)


def method_plan(shape: ModelShape, spec: Method, config: Any, dtype: str | torch.dtype, eval_seq_len: int, device: str,
                gguf: bool, layer_by_layer: bool = False, eval_tokens: int | None = None,
                shards: int = 1, recovery: RecoveryOptions | None = None,
                attention: AttentionSparsityOptions | None = None) -> MemoryPlan:
    """The plan of converting ``shape`` with ``spec`` and its built ``config`` in ``dtype`` on ``device`` (then
    thresholding its attention, where ``attention`` asks for it, and recovering it, where ``recovery`` asks for
    tokens); a CPU conversion of a safetensors checkpoint (not ``gguf``, which is dequantised) keeps it
    memory-mapped."""
    memory = spec.memory(shape, config, DTYPE_BYTES[dtype_name(dtype)])
    if attention is not None and attention.enabled:  # after the method's calibration: the larger of the two
        stage = attention_memory(shape, attention)
        memory = replace(memory, calib_tokens=max(memory.calib_tokens, stage.calib_tokens),
                         layer_statistics=max(memory.layer_statistics, stage.layer_statistics))
    on_cpu = str(device).split(":")[0] == "cpu"
    return plan_memory(shape, memory, dtype, eval_seq_len, inference_copy=spec.inference_copy,
                       mapped=on_cpu and not gguf, on_cpu=on_cpu, layer_by_layer=layer_by_layer,
                       eval_tokens=eval_tokens, shards=shards,
                       recovery=None if recovery is None else recovery_memory(shape, recovery))


def recovery_memory(shape: ModelShape, options: RecoveryOptions) -> MethodMemory | None:
    """A recovery's training, for the planner: the decoder's parameters of the parts it trains (the routers'
    are few and not counted; LoRA's own parameters, below 1 % of the model, neither), a micro-batch of its
    windows and a distillation loss."""
    if not options.enabled:
        return None
    parts = options.parts
    per_layer = {"attention": shape.decoder_params - shape.mlp_params, "experts": shape.mlp_params,
                 "shared": 0, "routers": 0, "norms": 0}  # the MLP's weights counted once, under experts
    if "shared" in parts and "experts" not in parts:
        per_layer["shared"] = shape.mlp_params
    trainable = 0 if options.recover_lora_rank else sum(per_layer[part] for part in parts)
    tokens = options.batch_size // options.recover_grad_accum * options.seq_len(shape.config)
    return MethodMemory(trainable=trainable, train_tokens=tokens, recompute=options.recover_recompute,
                        distillation=options.recover_lm_share < 1)  # the LM loss alone holds no teacher


def available_memory(device: str) -> int | None:
    """Bytes free for a conversion on ``device`` (CPU: the kernel's MemAvailable), or None if unknown."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None


def check_fits(memory: MemoryPlan, device: str, layer_by_layer_possible: bool = False) -> None:
    """Refuse, before any weight is read, a conversion whose estimated peak exceeds what ``device`` has free,
    naming what would make it fit."""
    free = available_memory(device)
    if free is None or memory.peak <= free:
        return
    phase = memory.peak_phase
    hints = []
    if layer_by_layer_possible and not memory.layer_by_layer:
        hints.append("--layer-by-layer (one decoder layer in memory at a time)")
    if memory.dtype == "float32":
        hints.append("--dtype bfloat16 (half the weights)")
    if phase == "convert":
        hints.append("fewer calibration windows (--set calib_samples=...) or a shorter --set seq_len")
    elif phase == "recover":
        hints.append("a smaller recovery micro-batch (--set recover_grad_accum=...), --set recover_recompute=true, "
                     "or LoRA (--set recover_lora_rank=8)")
    elif phase == "train":
        hints.append("a smaller micro-batch (--set grad_accum=...) and --set recompute=true")
        if FROZEN_IN_FLOAT32 in memory.phases[phase]:
            hints.append("the frozen weights kept in the working dtype (--set frozen_weights=working)")
        hints.append("the training sharded over several devices (torchrun --nproc_per_node N -m moeify convert "
                     "--fsdp ...)")
    else:
        hints.append("a shorter evaluation window (--seq-len)")
    hints.append("a machine or device with more memory")
    raise OptionError(f"this conversion needs about {memory.peak / GIB:.1f} GiB at its peak ({phase}), and "
                      f"{device} has {free / GIB:.1f} GiB free; try {', or '.join(hints)} "
                      f"(`moeify plan` shows the estimate by part)")
