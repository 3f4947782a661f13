"""moeify: turn a dense decoder-only LLM into a Mixture-of-Experts model, faithfully to the papers,
and measure what it cost in quality and what it bought in speed.

``import moeify`` stays light: the API functions import their heavy dependencies when called.
"""

__version__ = "0.1.0"

from moeify.api import ConversionResult, convert, evaluate, load, load_model, save, set_runtime_options  # noqa: E402

__all__ = ["ConversionResult", "__version__", "convert", "evaluate", "load", "load_model", "save",
           "set_runtime_options"]
