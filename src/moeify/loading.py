"""Loading models: a converted folder (moeify's native format), a dense local folder or hub name, a GGUF
file (or a folder holding exactly one), or the embedded default. Below the use cases, so that every one
of them (convert, evaluate, export, analyze, compare) loads the same way.

Every loader takes the working dtype (``float32``, ``bfloat16``, ``float16``); by default a checkpoint loads in
its own (``config.dtype``), and a GGUF file, whose weights are quantised, in float32.

GGUF files load through transformers' own GGUF reader (the ``gguf`` package): weights dequantised to the
working dtype, tokenizer from the file. transformers marks such a model as quantised and refuses to
save it, although its weights are ordinary float tensors by then; moeify removes that marker, so a
conversion of a GGUF model saves like any other.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from moeify.dtypes import working_dtype_name
from moeify.export.native import is_native_folder, load_native, native_config, native_model_class
from moeify.files import MOEIFY_KEY
from moeify.offload import layered_model
from moeify.offload.checkpoint import check_finite
from moeify.sources import ModelSource, model_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def working_dtype(dtype: str | torch.dtype | None, config: PreTrainedConfig | None) -> torch.dtype:
    """``moeify.dtypes.working_dtype_name`` as a torch dtype."""
    return DTYPES[working_dtype_name(dtype, config)]


def check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use --device cpu")


def load_config(model: str | Path | None) -> PreTrainedConfig:
    """The model's config without its weights (for validation before any heavy work); a converted folder's
    is its base model's config class with the ``moeify`` block (read without remote code)."""
    source = model_source(model)
    with _gguf_errors(source), _read_errors(source.path, "config.json"):
        if source.gguf_file is None and Path(source.path).is_dir() and is_native_folder(Path(source.path)):
            return native_config(Path(source.path))
        return AutoConfig.from_pretrained(source.path, **source.kwargs)


def converted_method(model: str | Path | None) -> str | None:
    """The method that converted ``model`` where it is a folder moeify converted, else None."""
    source = model_source(model)
    config = Path(source.path) / "config.json"
    if source.gguf_file is not None or not config.is_file():
        return None
    with _read_errors(source.path, "config.json"):
        block = json.loads(config.read_text()).get(MOEIFY_KEY)
    return None if block is None else str(block.get("method") or "moeify")


def _check_weights(model: torch.nn.Module, source: object) -> None:
    """Every weight of a loaded model finite (``check_finite``): the first that is not is named."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        check_finite(name, tensor, source)


def load(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None) -> PreTrainedModel:
    """Load a folder written by ``save`` (moeify's native format) with moeify's runtime classes, in ``dtype``
    (default: the dtype it was saved in)."""
    return load_native(Path(path), device, working_dtype(dtype, native_config(Path(path))))


def load_model(model: str | Path | None = None, device: str = "cpu", dtype: str | torch.dtype | None = None,
               layer_by_layer: bool = False) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) from a converted folder, a dense local folder or hub name, a GGUF file, or the
    embedded default (``None``), in ``dtype`` (default: the checkpoint's own; float32 for GGUF).

    ``layer_by_layer``: only the weights outside the decoder layers are read now; each layer is read from
    the checkpoint's safetensors files when a pass reaches it (``moeify.offload``: models larger than memory)."""
    check_device(device)
    source = model_source(model)
    if source.gguf_file is not None:
        if layer_by_layer:
            raise ValueError(f"{source}: layer-by-layer loading reads safetensors checkpoints, not GGUF files; "
                             "load the GGUF file whole and save it, or convert it to safetensors first")
        return _load_gguf(source, device, working_dtype(dtype, None))
    folder = Path(source.path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    with _read_errors(source.path, "config.json"):
        native = folder.is_dir() and is_native_folder(folder)
    with _read_errors(source.path, "tokenizer"):
        # A converted folder's tokenizer is the base model's: given the base config, AutoTokenizer needs no
        # remote code (and warns about no unknown model type).
        config = native_config(folder) if native else None
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False, config=config)
    with _read_errors(source.path, "weights"):
        if layer_by_layer:
            return _load_layered(folder, config, device, dtype), tokenizer
        if native:
            model = load_native(folder, device, working_dtype(dtype, config))
        else:
            dtype = working_dtype(dtype, AutoConfig.from_pretrained(source.path))
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(device).eval()
    _check_weights(model, source)
    return model, tokenizer


def _load_layered(folder: Path, native: PreTrainedConfig | None, device: str,
                  dtype: str | torch.dtype | None) -> PreTrainedModel:
    """A local checkpoint folder (dense, or converted: ``native`` its config) held a decoder layer at a time."""
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r}: layer-by-layer loading reads a local checkpoint folder")
    config = native if native is not None else AutoConfig.from_pretrained(folder)
    model_cls = native_model_class(config) if native is not None else MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    dtype = working_dtype(dtype, config)

    def build() -> PreTrainedModel:
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # as from_pretrained builds a model in its dtype
        try:
            return model_cls(config)
        finally:
            torch.set_default_dtype(default)

    return layered_model(folder, build, dtype, device)


@contextmanager
def _read_errors(path: str, what: str) -> Iterator[None]:
    """Whatever transformers or safetensors raise on a damaged file (OSError, JSON and header errors), as one
    ``ValueError`` naming the model and what could not be read."""
    try:
        yield
    except (json.JSONDecodeError, UnicodeDecodeError) as error:  # ValueErrors that name no file
        raise ValueError(f"{path}: cannot read the {what} ({type(error).__name__}: {error})") from error
    except (ValueError, FileNotFoundError):
        raise
    except Exception as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: cannot read the {what} ({type(error).__name__}: {detail})") from error


def _load_gguf(source: ModelSource, device: str, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    """The GGUF model dequantised to ``dtype`` and its tokenizer; the model's quantisation marker removed
    (its weights are plain float tensors already: only the marker made ``save_pretrained`` refuse)."""
    with _gguf_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(source.path, **source.kwargs)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **source.kwargs)
    _check_weights(model, source)
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.config.name_or_path = str(source)
    return model.to(device).eval(), tokenizer


@contextmanager
def _gguf_errors(source: ModelSource) -> Iterator[None]:
    """A GGUF file the reader cannot parse, or of an architecture transformers does not map, as one
    ``ValueError`` naming the file (the reader raises whatever its parser meets: struct, key, value errors)."""
    if source.gguf_file is None:
        yield
        return
    try:
        yield
    except Exception as error:
        detail = str(error).splitlines()[0] if str(error) else "no detail"
        raise ValueError(f"{source}: not a GGUF model transformers can read ({type(error).__name__}: {detail})") \
            from error
