"""Dense2MoE's inter-layer similarity (§2.2, Fig. 3) of a dense model on its own (``moeify analyze``):
S_L and S_M, their heatmaps, and every span ranked as the conversion's selection sees it."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from moeify.calibration.similarity import layer_similarity, similarity_heatmaps
from moeify.methods.dense2moe.build import rank_spans

SIMILARITY_NAME = "layer_similarity.json"


def similarity_analysis(model: PreTrainedModel, batches: Tensor, device: torch.device,
                        progress: bool) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(record entries ``similarity`` and ``spans``, files: the matrices as JSON and two heatmap PNGs)."""
    similarity = layer_similarity(model, batches, device=device, progress=progress)
    matrices = similarity.as_dict()
    artifacts = {SIMILARITY_NAME: (json.dumps(matrices, indent=1) + "\n").encode(), **similarity_heatmaps(similarity)}
    spans = [s.as_dict() for s in rank_spans(similarity.layer_output, similarity.mlp_input)]
    return {"similarity": matrices, "spans": spans}, artifacts
