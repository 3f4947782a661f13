"""Peak memory of a conversion, estimated from the model's config before any weight is read: ``moeify plan``,
and the check ``convert`` makes before loading the weights.

A conversion runs in phases, each holding the model's weights plus its own working set; the peak is the
largest phase plus what the process itself holds (Python, torch, transformers: measured here):

- ``evaluate dense``: the dense perplexity pass, ``EVAL_BATCH`` windows of the evaluation length at once:
  a decoder layer's activations (torch's attention kernels keep no seq x seq matrix) and one chunk of
  logits (``LOGIT_CHUNK`` positions) with their float32 copy and log-softmax.
- ``convert``: calibration, one decoder layer at a time (``calibration.stream``): every calibration
  window's hidden states twice (a layer's inputs and outputs, in float32 whatever the dtype), and the
  method's per-layer statistics (``Method.memory``: e.g. CMoE's (tokens x d_ff) activations and markers,
  MoRE's co-activation matrix and its spectral decomposition).
- ``train`` (methods that train): gradients and AdamW's two moments of what is trained, in float32 (a
  bfloat16/float16 model trains float32 master copies of those parameters: ``training.precision``), the
  activations a step keeps (with recomputation: every decoder layer's input plus one layer's
  working set) and a chunk of logits; in float32 when every parameter trains (the model computes in
  float32 then), else in the working dtype.
- ``recover`` (a recovery after the conversion): as ``train``, for the parts the recovery trains, plus
  the dense teacher's weights and its log-probabilities beside the student's.
- ``evaluate MoE``: as the dense pass, plus the packed copy of the routed experts an MoE layer holds at
  inference (``runtime.moe``: at most the converted layers' MLP weights).

Held a decoder layer at a time (``moeify.offload``, ``--layer-by-layer``), a conversion holds the weights
outside the decoder layers, one layer as read and as converted, and each pass's working set; the
evaluation passes hold the hidden states of every evaluation window instead of one batch.

On the CPU a safetensors checkpoint stays memory-mapped: its pages count once read, and what a
conversion writes (new expert weights, trained weights: copy-on-write) comes on top of them, so the
estimate adds the converted MLPs' weights (and a trained copy) there; on a GPU the replaced weights are
freed. Everything is for one process; data-parallel processes each hold all of it, unless the training is
sharded over them (``--fsdp``: a ``shard`` phase, the model made float32 and sharded a layer at a time, then
the training's per-parameter parts split among the processes). The estimate was checked
against the peak resident memory of conversions of a 1.1B-parameter model (``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from moeify.arch import UnsupportedFamilyError, family_for
from moeify.dtypes import DTYPE_BYTES, dtype_name
from moeify.files import MOEIFY_KEY
from moeify.presets import PRESETS
from moeify.sources import weight_files

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

    from moeify.options import MethodOptions

GIB = 2**30
PROCESS_BYTES = int(0.45 * GIB)  # Python, torch, transformers and moeify: a 260K-parameter conversion's peak
EVAL_BATCH = 8                   # windows per forward in ``evaluation.perplexity``
LOGIT_CHUNK = 1024               # positions whose logits exist at once (``evaluation.perplexity``)
CALIB_BYTES = 4                  # calibration caches hidden states in float32 (``calibration.stream``)



@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its config and its parameter counts, read from a checkpoint's
    headers (``from_checkpoint``) or counted on the meta device (``from_config``); no weights."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    context: int
    params: int
    mlp_params: int  # all decoder layers' MLPs
    decoder_params: int  # all decoder layers
    config: PreTrainedConfig = field(repr=False, compare=False)

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (their mean)."""
        return self.decoder_params // self.layers

    @classmethod
    def from_config(cls, config: PreTrainedConfig, name: str) -> ModelShape:
        """Counted on a model built on the meta device: any config transformers can build a model of."""
        import torch
        from transformers import AutoModelForCausalLM

        from moeify.arch import DecoderAdapter

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        adapter = DecoderAdapter(model)
        mlp = sum(p.numel() for i in range(adapter.num_layers) for p in adapter.mlp_module(i).parameters())
        decoder = sum(p.numel() for p in adapter.layers.parameters())
        return cls(name, config.hidden_size, config.intermediate_size, adapter.num_layers,
                   config.vocab_size, config.max_position_embeddings, sum(p.numel() for p in model.parameters()),
                   mlp, decoder, config)

    @classmethod
    def from_checkpoint(cls, folder: Path, name: str) -> ModelShape | None:
        """Read from ``folder``'s config.json and its safetensors headers, without torch (a command that
        needs no weights starts at once): every stored tensor counts, those under a decoder layer's MLP
        as MLP parameters (the family's names, ``moeify.arch``). None where these files cannot tell: no
        safetensors, a family moeify does not know, a config missing a size, a converted folder; the
        caller then builds the model on the meta device (``from_config``)."""
        files = weight_files(folder)
        if not (folder / "config.json").is_file() or not files:
            return None
        raw = json.loads((folder / "config.json").read_text())
        sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")
        if MOEIFY_KEY in raw or any(not isinstance(raw.get(key), int) for key in sizes):
            return None
        config = SimpleNamespace(**raw)
        config.dtype = raw.get("dtype") or raw.get("torch_dtype")
        try:
            family = family_for(config)
        except UnsupportedFamilyError:
            return None
        counts = {key: math.prod(shape) for file in files for key, shape in safetensors_shapes(file).items()}
        if raw.get("tie_word_embeddings"):
            counts.pop("lm_head.weight", None)  # where it is stored too, still one parameter in the model
        layers = f"{family.layers_path}."
        mlp = sum(n for key, n in counts.items()
                  if key.startswith(layers) and key[len(layers):].split(".", 2)[1:2] == [family.mlp_attr])
        return cls(name, raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"], raw["vocab_size"],
                   raw["max_position_embeddings"], sum(counts.values()), mlp,
                   sum(n for key, n in counts.items() if key.startswith(layers)), config)


def safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors file's header (its first 8 bytes give the header's length)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {key: value["shape"] for key, value in header.items() if key != "__metadata__"}


def preset_shape(name: str) -> ModelShape:
    from transformers import LlamaConfig

    return ModelShape.from_config(LlamaConfig(**PRESETS[name]), name)


# The training phase's part for a low-precision model whose frozen weights are held in float32 while it trains
FROZEN_IN_FLOAT32 = "frozen weights in float32"


@dataclass(frozen=True)
class MethodMemory:
    """A method's part of the estimate (``Method.memory``): the calibration windows it streams, its
    largest per-layer statistics (bytes), and, if it trains, how many parameters and tokens per
    micro-batch, with or without recomputation."""

    calib_tokens: int = 0
    layer_statistics: int = 0
    trainable: int = 0
    train_tokens: int = 0
    recompute: bool = True
    extra_train_activations: int = 0  # bytes per token and layer beyond a plain decoder layer's
    distillation: bool = False  # the loss is a KL against a teacher's log-probabilities (``training.losses``)
    frozen_in_float32: bool = False  # a low-precision model's frozen weights are held in float32 while training
    packed_share: float = 1.0  # the inference copy of the experts (``runtime.packed``) in dense MLPs' parameters


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per phase (each: {part: bytes}) and the work in tokens x layers."""

    shape: ModelShape
    dtype: str  # the working dtype's name ("bfloat16")
    phases: dict[str, dict[str, int]]
    work: dict[str, int]
    process: int  # what the process holds besides the phases' parts (on a GPU: nothing of the device's)
    layer_by_layer: bool = False

    @property
    def peak(self) -> int:
        return self.process + max(sum(parts.values()) for parts in self.phases.values())

    @property
    def output_bytes(self) -> int:
        """The saved model's size: the dense model's parameters in the working dtype (a conversion keeps every
        MLP weight or fewer, and adds routers of well under 1 %)."""
        return self.shape.params * DTYPE_BYTES[self.dtype]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: sum(self.phases[phase].values()))

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.shape.name, "params": self.shape.params, "dtype": self.dtype,
                "peak_gib": round(self.peak / GIB, 2), "peak_phase": self.peak_phase,
                "process_gib": round(self.process / GIB, 2), "layer_by_layer": self.layer_by_layer,
                "phases_gib": {phase: {k: round(v / GIB, 3) for k, v in parts.items()}
                               for phase, parts in self.phases.items()},
                "work": self.work}


def _layer_activations(shape: ModelShape, tokens: int, nbytes: int) -> int:
    """One decoder layer's working set on ``tokens`` positions (q, k, v, attention output, residuals, the
    MLP's gate, up and product)."""
    return tokens * (8 * shape.hidden + 4 * shape.intermediate) * nbytes


def _logits(shape: ModelShape, positions: int, nbytes: int) -> int:
    """A chunk of logits in the working dtype, its float32 copy and its log-softmax."""
    return min(positions, LOGIT_CHUNK) * shape.vocab * (nbytes + 8)


def _teacher_logits(shape: ModelShape, positions: int) -> int:
    """What a distillation loss's chunk holds beyond a cross-entropy's (``training.losses._chunk_kl``): the
    teacher's float32 log-probabilities beside the student's, and the KL's elementwise terms before their
    sum, two more float32 chunk-sized tensors."""
    return min(positions, LOGIT_CHUNK) * shape.vocab * 8


def _train_phase(shape: ModelShape, method: MethodMemory, b: int, written: int, mapped: bool) -> dict[str, int]:
    """A training phase's parts: the weights, what trains (float32 gradients, AdamW moments and master
    copies), the activations a step keeps and a chunk of logits."""
    tokens = method.train_tokens
    # A model whose every parameter trains computes in float32 (``training.precision``), as does one whose
    # frozen weights are held in float32 while training; else it computes in its dtype.
    upcast = method.frozen_in_float32 and b < 4
    ab = 4 if method.trainable >= shape.params or upcast else b
    per_layer = _layer_activations(shape, tokens, ab) + tokens * method.extra_train_activations
    kept = shape.layers * tokens * shape.hidden * ab + per_layer if method.recompute else shape.layers * per_layer
    trained = method.trainable * 4  # float32: trained in place, or as the low-precision weights' masters
    copy = trained if mapped or b < 4 else 0
    held = {FROZEN_IN_FLOAT32: shape.params * 4} if upcast else {"weights": shape.params * b}
    phase = {**held, "converted weights": written, "trained copy": copy, "gradients": trained,
             "optimizer": 2 * trained, "activations": kept, "logits": _logits(shape, tokens, ab)}
    if method.distillation:
        phase["teacher log-probabilities"] = _teacher_logits(shape, tokens)
    return phase


def plan_memory(shape: ModelShape, method: MethodMemory, dtype: str | torch.dtype, eval_seq_len: int,
                inference_copy: bool = True, mapped: bool = True, on_cpu: bool = True, layer_by_layer: bool = False,
                eval_tokens: int | None = None, shards: int = 1, recovery: MethodMemory | None = None) -> MemoryPlan:
    """The estimate of a conversion of ``shape`` in ``dtype`` (see the module docstring); ``inference_copy``:
    the converted layers hold a packed copy of their experts at inference (routed, disjoint experts);
    ``mapped``: the checkpoint stays memory-mapped beside what the conversion writes (CPU, safetensors);
    ``on_cpu``: the estimate is of the process's memory (else of the GPU's: the process's own not in it);
    ``layer_by_layer``: the model is held a decoder layer at a time (``moeify.offload``), its evaluation
    then keeps every one of the ``eval_tokens`` positions' hidden states (default: one batch of windows);
    ``shards``: training sharded over that many processes (``training.sharding``, FSDP); ``recovery``: the
    training part of a recovery after the conversion (``training.recovery``: a ``recover`` phase with the
    dense teacher's weights beside the student's)."""
    dtype = dtype_name(dtype)
    if layer_by_layer:
        return _plan_layer_by_layer(shape, method, dtype, eval_seq_len, inference_copy, on_cpu,
                                    eval_tokens or EVAL_BATCH * eval_seq_len)
    b = DTYPE_BYTES[dtype]
    weights = shape.params * b
    written = shape.mlp_params * b if mapped else 0  # the converted MLPs, beside the mapped checkpoint
    eval_tokens = EVAL_BATCH * eval_seq_len
    evaluation = {"weights": weights, "activations": _layer_activations(shape, eval_tokens, b),
                  "logits": _logits(shape, eval_tokens, b)}
    phases = {"evaluate dense": evaluation}
    if method.calib_tokens or method.layer_statistics:
        phases["convert"] = {"weights": weights, "converted weights": written,
                             "calibration hidden states": 2 * method.calib_tokens * shape.hidden * CALIB_BYTES,
                             "layer statistics": method.layer_statistics}
    if method.train_tokens:
        phases["train"] = _train_phase(shape, method, b, written, mapped)
        if shards > 1 and method.trainable >= shape.params:
            phases.update(_sharded_training(shape, phases.pop("train"), shards))
    if recovery is not None and recovery.train_tokens:
        # the dense teacher beside the student (reloaded, not memory-mapped: the student's pages are its own)
        phases["recover"] = {**_train_phase(shape, recovery, b, written, mapped), "teacher weights": weights}
    packed = round(shape.mlp_params * b * method.packed_share) if inference_copy else 0
    phases["evaluate MoE"] = {**evaluation, "converted weights": written, "packed experts": packed}
    work = {"calibration tokens x layers": method.calib_tokens * shape.layers,
            "training tokens per micro-batch x layers": method.train_tokens * shape.layers}
    return MemoryPlan(shape, dtype, phases, work, PROCESS_BYTES if on_cpu else 0)


def _sharded_training(shape: ModelShape, train: dict[str, int], shards: int) -> dict[str, dict[str, int]]:
    """The training phase of a model whose every parameter trains, sharded over ``shards`` processes: each
    keeps 1/shards of the decoder layers' weights, gradients and optimizer state, the rest replicated, plus
    one layer gathered while it computes; and the sharding itself (``training.sharding``): the model as the
    conversion left it, a layer at a time made float32 and sharded, the shards made so far beside it.
    Models that train a small part of themselves (ToMoE, LoRA) are planned unsharded: their training state
    is small, and ToMoE's frozen MLP weights stay whole."""
    share = shape.decoder_params / shape.params

    def split(n: int) -> int:
        return round(n * (1 - share) + n * share / shards)

    per_param = ("weights", "trained copy", "gradients", "optimizer")
    steady = {part: split(n) if part in per_param else n for part, n in train.items()}
    steady["one layer gathered"] = shape.layer_params * 4
    start = {"weights": train["weights"], "converted weights": train["converted weights"],
             "float32 replicated part": round(shape.params * (1 - share)) * 4,
             "one layer in float32": shape.layer_params * 4,
             "float32 shards": round(shape.decoder_params * 4 / shards)}
    return {"shard": start, "train": steady}


def _plan_layer_by_layer(shape: ModelShape, method: MethodMemory, dtype: str, eval_seq_len: int,
                         inference_copy: bool, on_cpu: bool, eval_tokens: int) -> MemoryPlan:
    """``plan_memory`` of a model held a decoder layer at a time: the weights outside the layers, one layer
    as read and as converted (its dtype copy and the method's new layer), and each pass's activations; the
    evaluation passes keep every window's hidden states three times (a layer's inputs and outputs, and the
    final states the scoring reads)."""
    b = DTYPE_BYTES[dtype]
    resident = {"weights outside the layers": (shape.params - shape.decoder_params) * b,
                "one layer, read and converted": 2 * shape.layer_params * b}
    batch = EVAL_BATCH * eval_seq_len
    evaluation = {**resident, "evaluation hidden states": 3 * eval_tokens * shape.hidden * b,
                  "activations": _layer_activations(shape, min(batch, eval_tokens), b),
                  "logits": _logits(shape, batch, b)}
    phases = {"evaluate dense": evaluation}
    if method.calib_tokens or method.layer_statistics:
        phases["convert"] = {**resident,
                             "calibration hidden states": 2 * method.calib_tokens * shape.hidden * CALIB_BYTES,
                             "layer statistics": method.layer_statistics}
    packed = round(shape.mlp_params // shape.layers * b * method.packed_share) if inference_copy else 0
    phases["evaluate MoE"] = {**evaluation, "packed experts": packed}
    work = {"calibration tokens x layers": method.calib_tokens * shape.layers,
            "training tokens per micro-batch x layers": 0}
    return MemoryPlan(shape, dtype, phases, work, PROCESS_BYTES if on_cpu else 0, layer_by_layer=True)


def method_memory(shape: ModelShape, cfg: MethodOptions, nbytes: int, *, layer_statistics: int | None = None,
                  trainable: int | None = None, extra_train_activations: int = 0,
                  distillation: bool = False, frozen_in_float32: bool = False,
                  packed_share: float = 1.0) -> MethodMemory:
    """A method's part of the estimate from what its config declares (``options.MethodOptions``): the
    calibration windows it draws; its training phase (every parameter trained, unless ``trainable`` says
    otherwise; a LoRA fine-tune's own parameters, below 1 % of the model, are not counted);
    ``layer_statistics`` by default what one calibration window's MLP hidden activations take in float32
    (gate, up and their product); ``packed_share``: the experts' packed inference copy in dense MLPs (1: the
    experts partition the MLP; more where they overlap)."""
    windows, seq = cfg.calibration_windows(shape.config)
    calib = windows * seq
    stats = 3 * seq * shape.intermediate * 4 if layer_statistics is None else layer_statistics
    memory = MethodMemory(calib_tokens=calib, layer_statistics=stats if calib else 0, packed_share=packed_share)
    training = cfg.training(shape.config)
    if training is None:
        return memory
    count = 0 if training.lora else (shape.params if trainable is None else trainable)
    micro_batch = training.batch_size // training.grad_accum * training.seq_len
    return MethodMemory(calib, memory.layer_statistics, count, micro_batch, training.recompute,
                        extra_train_activations, distillation, frozen_in_float32, packed_share)
