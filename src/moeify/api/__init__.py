"""The use cases, one module each: ``convert`` (and ``save``), ``recover`` (a distillation after a conversion,
``recover_run`` for a saved one), ``evaluate`` (and runtime options),
``export`` (standard MoE formats), ``analyze`` (a method's analysis of a dense model), ``compare`` (every
method at a matched budget), ``plan`` (a conversion's peak memory, before it runs). They return values and print nothing; ``moeify.cli`` prints."""

from __future__ import annotations

from moeify.api.analyze import LayerAnalysis, analyze_layers, save_analysis
from moeify.api.compare import run_comparison
from moeify.api.convert import convert, save
from moeify.api.evaluate import evaluate, set_runtime_options
from moeify.api.export import check_formats, export_folder
from moeify.api.recover import recover_run
from moeify.api.result import ConversionResult
from moeify.loading import load, load_model
from moeify.memory_plan import plan
from moeify.sources import EMBEDDED_MODEL

__all__ = ["EMBEDDED_MODEL", "ConversionResult", "LayerAnalysis", "analyze_layers", "check_formats", "convert",
           "evaluate", "export_folder", "load", "load_model", "plan", "recover_run", "run_comparison", "save",
           "save_analysis", "set_runtime_options"]
