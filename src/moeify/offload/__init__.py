"""Models larger than memory: decoder layers read from safetensors files one at a time, converted layers
written one at a time (``layered``), over a by-name reader of safetensors checkpoints (``checkpoint``)."""

from moeify.offload.layered import LayeredModel, cast_new_state, layered_model, layered_of

__all__ = ["LayeredModel", "cast_new_state", "layered_model", "layered_of"]
