"""moeify: turn a dense decoder-only LLM into a Mixture-of-Experts model, faithfully to the papers,
and measure what it cost in quality and what it bought in speed.

``import moeify`` stays light: the API's names are imported on first use (PEP 562), and the API
functions import their heavy dependencies when called.
"""

from __future__ import annotations

from typing import Any

from moeify.version import __version__

__all__ = ["ConversionResult", "__version__", "convert", "evaluate", "load", "load_model", "plan", "save",
           "set_runtime_options"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import moeify.api

        return getattr(moeify.api, name)
    raise AttributeError(f"module 'moeify' has no attribute {name!r}")
