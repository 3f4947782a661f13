"""Layer streaming replays every decoder layer with its own arguments and reproduces the model's forward."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import FAMILY_NAMES, VARIANT_NAMES, tiny_model

SEQ = 32
WINDOW = 8  # shorter than SEQ: a layer replayed with another layer's mask computes something else

# Families whose config has a sliding window, set so that the layers differ where the family allows it
# (Qwen2/Qwen3: full attention below max_window_layers, sliding above).
SLIDING: dict[str, dict] = {
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


@pytest.mark.parametrize("family", FAMILY_NAMES + VARIANT_NAMES)
def test_layer_streaming_equals_the_models_forward(family):
    from moeify.arch import DecoderAdapter
    from moeify.calibration.stream import stream_layers

    model = tiny_model(family, **SLIDING.get(family, {}))
    batches = torch.randint(3, 128, (3, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(input_ids=batches, output_hidden_states=True).hidden_states
    adapter = DecoderAdapter(model)
    for step in stream_layers(model, adapter, batches, device="cpu", batch_size=2):
        torch.testing.assert_close(torch.cat(step.inputs.hidden), hidden[step.index], atol=1e-5, rtol=1e-5)
    # the last layer's output too (the model's last hidden state is after the final norm: compare before it)
    assert len(hidden) == adapter.num_layers + 1


def test_a_sliding_window_makes_the_layers_arguments_differ():
    """The test above would pass trivially if the tiny models' layers all got the same mask."""
    from moeify.arch import DecoderAdapter
    from moeify.calibration.stream import capture_layer_inputs

    model = tiny_model("qwen2", **SLIDING["qwen2"])
    adapter = DecoderAdapter(model)
    _, kwargs = capture_layer_inputs(model, adapter, torch.randint(3, 128, (1, SEQ)), 1)
    masks = [layer[0]["attention_mask"] for layer in kwargs]
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert masks[0] is None or masks[1] is None or not torch.equal(masks[0], masks[1])
    assert masks[0] is not masks[1]


def test_a_bfloat16_conversion_leaves_no_float32_copy_of_its_experts(make_ctx):
    """The stream computes a low-precision model's layers in float32; the packed copy of the converted layer's
    experts that this builds is dropped with the layer's return to bfloat16, not held until the next forward
    (on a GPU: the whole model's experts twice over in float32 at the evaluation's start)."""
    from moeify.methods.cmoe import CmoeConfig
    from moeify.methods.cmoe.convert import convert
    from moeify.moe.accounting import moe_layers
    from moeify.options import build_config

    model = tiny_model("llama", vocab_size=512).to(torch.bfloat16)
    convert(make_ctx(model), build_config(CmoeConfig, {"calib_samples": 2, "seq_len": 32}))
    layers = moe_layers(model)
    assert layers and all(layer._packed is None for layer in layers)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 8)))
    assert all(layer._packed[1].first.dtype == torch.bfloat16 for layer in layers)  # built again, in bfloat16
