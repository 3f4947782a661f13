"""k-quant GGUF files through llama.cpp's own quantiser: the ``llama-quantize`` program of an installed
llama.cpp (on PATH) or, failing that, llama-cpp-python's binding of the same function. The ``gguf``
package encodes f16 and q8_0 but not the k-quants, whose block search lives in llama.cpp's C code.

llama.cpp picks each tensor's type from the file type and the model's shape. One of its rules is sized for
Mixtral: in a model of exactly 8 experts the attention's keys and values go to Q8_0 and its output
projection to Q5_K, cheap where the attention is a small share of the weights. A converted model keeps the
dense model's attention whole, so there the rule would store that attention in more bits than the dense
model's file of the same quantisation, and every token would read them. moeify overrides the rule
(``dense_attention_types``): the attention of an 8-expert file gets the types llama.cpp gives a model
without experts, and the file differs from the dense model's in its MLPs alone.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# moeify's name -> llama.cpp's file type (llama_ftype: its name for llama-quantize and its number)
LLAMA_QUANTS = {"q4_k_m": ("Q4_K_M", 15)}
# llama.cpp's expert count that gives the attention more bits (llama-quant.cpp, ``n_expert == 8``)
MIXTRAL_EXPERTS = 8


def quantiser() -> str:
    """Which quantiser is installed (``llama-quantize`` or ``llama-cpp-python``), or a clear error."""
    if shutil.which("llama-quantize"):
        return "llama-quantize"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ValueError("--quant q4_k_m needs llama.cpp's quantiser: llama-quantize on PATH (a llama.cpp build) "
                         "or `pip install llama-cpp-python`; f32, f16 and q8_0 need neither") from None
    return "llama-cpp-python"


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose value projection Q4_K_M stores in Q6_K (the first and
    last eighth, and every third layer between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def dense_attention_types(source: Path, quant: str) -> dict[str, str]:
    """Tensor-name pattern -> type for the attention of an 8-expert ``source`` quantised as ``quant``: the
    types llama.cpp's ``quant`` gives the same tensors in a model without experts; empty for any other
    expert count (llama.cpp's own choice is then the dense model's already)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    if experts is None or experts.contents() != MIXTRAL_EXPERTS or quant != "q4_k_m":
        return {}
    layers = reader.fields[f"{arch}.block_count"].contents()
    types = {}
    for layer in range(layers):
        for part in ("attn_k", "attn_output"):
            types[rf"^blk\.{layer}\.{part}\.weight$"] = "q4_k"
        types[rf"^blk\.{layer}\.attn_v\.weight$"] = "q6_k" if more_bits(layer, layers) else "q4_k"
    return types


def llama_quantize(source: Path, out: Path, quant: str) -> None:
    """Quantise the GGUF ``source`` (f16) into ``out`` as ``quant``, with llama.cpp's defaults (its mix of
    types per tensor, no importance matrix) but for an 8-expert model's attention (``dense_attention_types``)."""
    name, ftype = LLAMA_QUANTS[quant]
    overrides = dense_attention_types(source, quant)
    if quantiser() == "llama-quantize":
        types = [arg for pattern, qtype in overrides.items() for arg in ("--tensor-type", f"{pattern}={qtype}")]
        done = subprocess.run(["llama-quantize", *types, str(source), str(out), name], capture_output=True,
                              text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if overrides:  # a C array ended by a null pattern; kept alive by ``table`` for the call
        table = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))(
            *[(pattern.encode(), getattr(llama_cpp, f"GGML_TYPE_{qtype.upper()}"))
              for pattern, qtype in overrides.items()], (None, 0))
        params.tt_overrides = ctypes.cast(table, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {name}")
