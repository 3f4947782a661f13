"""The tensors of a standard-format export under llama.cpp's GGUF names, in the types a GGUF quantisation
gives them.

Names and layouts are llama.cpp's (``gguf.TENSOR_NAMES``), as its ``convert_hf_to_gguf.py`` writes them for
the same checkpoint: q and k rows are permuted from transformers' rotate-half rotary layout to llama.cpp's
interleaved one, a Granite ``gate_up`` projection is split into its gate and up halves, experts stay
stacked (E, width, hidden). Norms, biases and routers stay float32 (llama.cpp computes them in float32
whatever the file type); every other matrix takes the quantisation's type, or float16 where its rows do
not split into the type's blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from torch import Tensor
from transformers import PretrainedConfig

GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
# per decoder layer: transformers' name after "model.layers.N." -> llama.cpp's after "blk.N."
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight",
         "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
         "block_sparse_moe.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
         "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
         "shared_mlp.input_linear.weight": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
         "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
         "mlp.experts.down_proj": "ffn_down_exps.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
# routers and the shared expert's gate vector: llama.cpp keeps them float32 in every file type
FLOAT32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
VECTORS = ("ffn_gate_inp_shexp.weight",)  # (1, d) in transformers, (d,) in llama.cpp
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")

# file type -> (GGUF file type, the type of the tensors that are quantised)
FILE_TYPES = {"f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
              "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
              "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0)}


class UnmappedTensor(ValueError):
    """A tensor of the export that has no place in llama.cpp's layout of the architecture."""


def rotary_interleaved(weight: Tensor, heads: int) -> Tensor:
    """Rows of a q or k projection (or bias) reordered from rotate-half pairs (i, i + d/2) to adjacent pairs
    (2i, 2i + 1) within each head: llama.cpp rotates adjacent pairs."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(state: dict[str, Tensor], config: PretrainedConfig, interleave: bool = True,
                 tied_output: bool = False) -> Iterator[tuple[str, Tensor]]:
    """``state`` (a standard-format model's tensors) as (llama.cpp name, tensor), in float32; ``interleave``:
    q and k rows into llama.cpp's adjacent-pair rotary layout (its llama and granite; its qwen2 rotates
    halves, as transformers does); ``tied_output``: write a tied output head too (an architecture that
    does not read a missing one as the embedding)."""
    for key, value in state.items():
        if key == "lm_head.weight" and config.tie_word_embeddings and not tied_output:
            continue  # llama.cpp reads a missing output.weight as the tied embedding
        value = value.detach().float().cpu()
        if key in GLOBAL:
            yield GLOBAL[key], value
            continue
        match = _LAYER_KEY.fullmatch(key)
        if match is None or match.group(2) not in LAYER:
            raise UnmappedTensor(f"{key!r} has no llama.cpp name in this architecture")
        block, name = match.group(1), match.group(2)
        if interleave and name.startswith("self_attn.q_proj."):
            value = rotary_interleaved(value, config.num_attention_heads)
        elif interleave and name.startswith("self_attn.k_proj."):
            value = rotary_interleaved(value, config.num_key_value_heads)
        target = LAYER[name]
        if target in VECTORS:
            value = value.flatten()
        if isinstance(target, tuple):  # a fused gate and up projection: gate rows first
            for half, part in zip(target, value.chunk(2, dim=-2)):
                yield f"blk.{block}.{half}", part.contiguous()
        else:
            yield f"blk.{block}.{target}", value


def tensor_type(name: str, value: Tensor, quantised: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The type ``name`` is stored in when the file's matrices take ``quantised``."""
    if value.dim() <= 1 or name.endswith("_norm.weight") or name.endswith(FLOAT32_ALWAYS) \
            or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[quantised]
    if value.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16  # rows that do not split into blocks: as llama.cpp's converter
    return quantised


def encoded(value: Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``value`` as the bytes (or float array) ``GGUFWriter.add_tensor`` takes for ``qtype``."""
    array = value.to(torch.float32).numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return array
    return gguf.quants.quantize(array, qtype)
