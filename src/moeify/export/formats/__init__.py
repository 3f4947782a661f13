"""The standard Hugging Face MoE architectures moeify writes (one module each; what they share in ``common``),
registered by name: adding a format is a module here and its line in ``FORMATS``."""

from __future__ import annotations

from moeify.export.formats.common import Source, TargetFormat
from moeify.export.formats.glm4_moe import Glm4Moe
from moeify.export.formats.granitemoeshared import GraniteMoeShared
from moeify.export.formats.llama import Llama
from moeify.export.formats.mixtral import Mixtral
from moeify.export.formats.qwen2_moe import Qwen2Moe

FORMATS: dict[str, TargetFormat] = {f.name: f for f in (Glm4Moe(), Qwen2Moe(), Mixtral(), GraniteMoeShared(), Llama())}

__all__ = ["FORMATS", "Source", "TargetFormat"]
