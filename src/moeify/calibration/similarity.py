"""Inter-layer similarity of a decoder (Dense2MoE §2.2, Eq. 4-5), gathered one decoder layer at a time.

For calibration tokens t and decoder layers l, m (0-based):

- ``S_L[l][m] = mean_t s(x_t^(l), x_t^(m))``, x^(l) the output of decoder layer l (the residual stream
  after it);
- ``S_M[l][m] = mean_t s(h_t^(l), h_t^(m))``, h^(l) the residual-stream vector layer l's MLP branch
  reads, before its norm: x + MHA(x) (Eq. 3) in sequential families, the layer input in
  parallel-residual ones (GPT-NeoX, Phi), whose MLP reads that;

with s the cosine similarity (Eq. 4-5) of one token's two vectors, averaged over the tokens (the paper
does not say how tokens are pooled; a per-token cosine is what the layer-pruning work it builds on,
Gromov et al. and ShortGPT, averages). Both matrices are symmetric with a unit diagonal; the paper's lists
S_L and S_M are their upper triangles (pairs l, l + n with n >= 1).

Which x^(l): Eq. 1 calls x^(l) a block's input, but §2.3 and Eq. 6 (layer l* is kept, layers
l*+1 .. l*+n* are removed, and the result stands for x^(l*+n*)) need x^(l) to be layer l's output:
then a high s(x^(l), x^(l+n)) says that layers l+1 .. l+n changed the residual stream little, which is
what makes them the ones to remove. We use the output.

Memory: every pair needs both layers' vectors, so the unit vectors of x and h are kept for every layer
and calibration token (2 N T d floats, on the CPU; no copy of them is made); lower the calibration tokens
for large models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from moeify.arch import DecoderAdapter
from moeify.calibration.hooks import capture_inputs
from moeify.calibration.stream import stream_layers


def unit_rows(chunks: list[Tensor]) -> Tensor:
    """The tokens of ``chunks`` (each (..., d)) as unit vectors: (tokens, d), float32 on the CPU."""
    rows = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks]).float().cpu()
    return torch.nn.functional.normalize(rows, dim=-1)


def mean_cosine_matrix(units: list[Tensor]) -> Tensor:
    """M[l][m] = mean_t u_l(t) . u_m(t) for unit vectors u_l: (tokens, d) per layer -> (layers, layers): the
    sum over tokens of the per-token cosines is one dot product of the flattened vectors (Eq. 4-5), taken pair
    by pair so that no copy of the N T d floats is made."""
    flat = [u.reshape(-1) for u in units]
    matrix = torch.empty(len(flat), len(flat))
    for l, a in enumerate(flat):
        for m in range(l, len(flat)):
            matrix[l, m] = matrix[m, l] = torch.dot(a, flat[m])
    return matrix / units[0].shape[0]


@dataclass(frozen=True)
class LayerSimilarity:
    """S_L (``layer_output``) and S_M (``mlp_input``) as nested lists, and the tokens they average over."""

    layer_output: list[list[float]]
    mlp_input: list[list[float]]
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_similarity(model: PreTrainedModel, batches: Tensor, *, device: torch.device | str, batch_size: int = 8,
                     progress: bool = False) -> LayerSimilarity:
    """S_L and S_M of ``model`` on the calibration ``batches`` (n, seq), streamed layer by layer."""
    adapter = DecoderAdapter(model)
    outputs, mlp_inputs = [], []
    steps = stream_layers(model, adapter, batches, device=device, batch_size=batch_size)
    for step in tqdm(steps, total=adapter.num_layers, desc="layer similarity", disable=not progress):
        seen: list[Tensor] = []
        with capture_inputs(adapter.mlp_input_module(step.index), seen.append):
            outputs.append(unit_rows(step.run()))  # x^(l)
        mlp_inputs.append(unit_rows(seen))  # h^(l)
    return LayerSimilarity(layer_output=mean_cosine_matrix(outputs).tolist(),
                           mlp_input=mean_cosine_matrix(mlp_inputs).tolist(), tokens=outputs[0].shape[0])


def similarity_heatmaps(similarity: LayerSimilarity) -> dict[str, bytes]:
    """Fig. 3 of the paper for this model: one PNG per matrix (name -> bytes)."""
    from moeify.plots import heatmap

    labels = [str(i) for i in range(len(similarity.layer_output))]
    return {
        "layer_output_similarity.png": heatmap(similarity.layer_output, row_labels=labels, xlabel="layer",
                                               title="S_L: cosine of decoder-layer outputs (Eq. 4)", vmax=1.0),
        "mlp_input_similarity.png": heatmap(similarity.mlp_input, row_labels=labels, xlabel="layer",
                                            title="S_M: cosine of MLP inputs (Eq. 5)", vmax=1.0),
    }
