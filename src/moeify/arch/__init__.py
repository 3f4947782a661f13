"""The architecture layer: the only part of moeify that knows the module names of model families."""

from moeify.arch.adapter import DecoderAdapter, NotDenseMlpError
from moeify.arch.families import FAMILIES, FamilySpec, UnsupportedFamilyError, family_for, supported_model_types
from moeify.arch.mlp import MlpWeights

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
