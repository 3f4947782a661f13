"""k-quant GGUF files through llama.cpp's own quantiser: the ``llama-quantize`` program of an installed
llama.cpp (on PATH) or, failing that, llama-cpp-python's binding of the same function. The ``gguf``
package encodes f16 and q8_0 but not the k-quants, whose block search lives in llama.cpp's C code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# moeify's name -> llama.cpp's file type (llama_ftype: its name for llama-quantize and its number)
LLAMA_QUANTS = {"q4_k_m": ("Q4_K_M", 15)}


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


def llama_quantize(source: Path, out: Path, quant: str) -> None:
    """Quantise the GGUF ``source`` (f16) into ``out`` as ``quant``, with llama.cpp's defaults (its mix of
    types per tensor, no importance matrix)."""
    name, ftype = LLAMA_QUANTS[quant]
    if quantiser() == "llama-quantize":
        done = subprocess.run(["llama-quantize", str(source), str(out), name], capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {name}")
