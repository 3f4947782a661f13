"""The architecture layer: the only part of moeify that knows the module names of model families.

The families are plain data and import nothing heavy, so what reads only them (``moeify plan`` of a
checkpoint folder) starts without torch; the adapter and the MLP views import torch when first named."""

from typing import Any

from moeify.arch.families import FAMILIES, FamilySpec, UnsupportedFamilyError, family_for, supported_model_types

_HEAVY = {"DecoderAdapter": "moeify.arch.adapter", "NotDenseMlpError": "moeify.arch.adapter",
          "MlpWeights": "moeify.arch.mlp"}


def __getattr__(name: str) -> Any:
    if name in _HEAVY:
        import importlib

        return getattr(importlib.import_module(_HEAVY[name]), name)
    raise AttributeError(f"module 'moeify.arch' has no attribute {name!r}")


__all__ = [
    "DecoderAdapter",
    "FAMILIES",
    "FamilySpec",
    "MlpWeights",
    "NotDenseMlpError",
    "UnsupportedFamilyError",
    "family_for",
    "supported_model_types",
]
