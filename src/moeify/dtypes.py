"""The working dtypes by name, for what decides a dtype before torch is imported (``moeify plan``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype: str | torch.dtype) -> str:
    """"bfloat16" for ``torch.bfloat16`` or "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def working_dtype_name(dtype: str | torch.dtype | None, config: Any) -> str:
    """The working dtype's name: ``dtype`` (by name or as a torch dtype); None: the checkpoint's own floating
    dtype (``config``'s), else float32 (a GGUF model, a config that names none)."""
    if dtype is not None:
        if dtype_name(dtype) not in DTYPE_BYTES:
            shown = repr(dtype) if isinstance(dtype, str) else str(dtype)
            raise ValueError(f"dtype={shown} is not a working dtype; allowed: {', '.join(DTYPE_BYTES)}")
        return dtype_name(dtype)
    own = getattr(config, "dtype", None) if config is not None else None
    return dtype_name(own) if own is not None and dtype_name(own) in DTYPE_BYTES else "float32"
