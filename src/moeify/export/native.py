"""moeify's native format: the base model's checkpoint layout plus MoE layers, loadable by transformers.

The folder holds ``config.json`` (the base config with ``model_type = "moeify_<base>"``, an ``auto_map``
and a ``moeify`` block listing every MoE layer's structure and, for a model that lost decoder layers, their
parameter counts: ``removed_layers``, see ``moe.depth``; the shorter structure itself is the config's own
``num_hidden_layers``), ``model.safetensors`` (a model held a layer at a time, ``moeify.offload``: one
shard per decoder layer and the index), the tokenizer, verbatim copies of the runtime modules
(``RUNTIME_FILES``: ``moe.py``, ``experts.py``, ``routers.py``, ``dispatch.py``, ``packed.py``, ``few_pairs.py``,
``attention.py``, ``sparse_inputs.py``, which import each other relatively, so they run the same in the package
and in the folder) and ``modeling_moeify.py``. Attention modules with a pruned head dimension are listed under
``moeify.attention``, projections with thresholded inputs (TEAL) under ``moeify.sparse_inputs``. The changed
``model_type`` makes a plain ``from_pretrained`` without ``trust_remote_code`` fail loudly instead of silently
loading dense MLPs with missing weights.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from moeify.arch.families import NATIVE_PREFIX
from moeify.files import MOEIFY_KEY
from moeify.offload import layered_of
from moeify.runtime import attention as runtime_attention
from moeify.runtime import moe as runtime_moe
from moeify.runtime import sparse_inputs as runtime_sparse

RUNTIME_FILES = ("moe.py", "experts.py", "routers.py", "dispatch.py", "packed.py", "few_pairs.py", "attention.py",
                 "sparse_inputs.py")


def save_native(model: PreTrainedModel, folder: Path, tokenizer: Any = None, method: str = "") -> None:
    """Write ``model`` (with its MoE layers) into ``folder`` (which should come from ``atomic_dir``)."""
    from moeify.version import __version__

    folder = Path(folder)
    base_type = model.config.model_type
    layered = layered_of(model)
    if layered is None:
        # Custom (moeify) classes get no checkpoint renaming when loading, so the file keeps in-memory names.
        model.save_pretrained(folder, save_original_format=False)
    else:  # a model held a layer at a time: its weights a shard per layer, the config as save_pretrained writes it
        layered.save_weights(folder)
        model.config.dtype = layered.dtype
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(folder)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update({
        "model_type": f"{NATIVE_PREFIX}{base_type}",
        "architectures": ["MoeifyForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_moeify.MoeifyConfig",
                     "AutoModelForCausalLM": "modeling_moeify.MoeifyForCausalLM"},
        MOEIFY_KEY: {**(getattr(model.config, MOEIFY_KEY, None) or {}),  # e.g. removed_layers (moe.depth)
                     "format_version": runtime_moe.FORMAT_VERSION, "method": method,
                     "base_model_type": base_type, "layers": runtime_moe.moe_layer_specs(model),
                     "attention": runtime_attention.pruned_attention_specs(model),
                     "sparse_inputs": runtime_sparse.sparse_input_specs(model)},
    })
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    runtime = resources.files("moeify.runtime")
    for name in RUNTIME_FILES:
        (folder / name).write_text(runtime.joinpath(name).read_text())
    template = runtime.joinpath("remote_template.py.txt").read_text()
    base_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(model.config)]
    (folder / "modeling_moeify.py").write_text(template.format(
        version=__version__, method=method or "moeify", config_class=type(model.config).__name__,
        model_class=base_cls.__name__, model_type=f"{NATIVE_PREFIX}{base_type}"))


def is_native_folder(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and MOEIFY_KEY in json.loads(config.read_text())


def native_config(path: Path) -> Any:
    """The base model's config class holding a native folder's config (its ``moeify`` block included),
    read without remote code."""
    raw = json.loads((Path(path) / "config.json").read_text())
    block = raw[MOEIFY_KEY]
    if block.get("format_version") != runtime_moe.FORMAT_VERSION:
        raise ValueError(f"{path}: moeify format_version={block.get('format_version')} is not supported "
                         f"(this moeify reads {runtime_moe.FORMAT_VERSION})")
    config_cls = CONFIG_MAPPING[block["base_model_type"]]
    for key in ("model_type", "auto_map", "architectures"):
        raw.pop(key, None)
    return config_cls.from_dict(raw)


def native_model_class(config: Any) -> type:
    """moeify's runtime class for a native folder's config (``native_config``)."""
    return runtime_moe.moe_causal_lm_class(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], None,
                                           runtime_attention.install_pruned_attention,
                                           runtime_sparse.install_sparse_inputs)


def load_native(path: Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a native folder with moeify's own runtime classes (so moeify can inspect and re-route it)."""
    path = Path(path)
    config = native_config(path)
    model = native_model_class(config).from_pretrained(path, config=config, dtype=dtype)
    return model.to(device).eval()

