"""``moeify export --dense-layers``: routed layers written as dense MLPs of every neuron they hold, so that one
layer that keeps most of its neurons does not set the padded widths of every other layer. The dense form is
the layer with every expert on (each neuron once); ``auto`` picks the layers that make a format's layout
cheapest, and none where the format has no dense layers of their own width."""

import json

import pytest
import torch

import moeify
from moeify.api import ConversionResult
from moeify.arch import DecoderAdapter
from moeify.cli.main import main
from moeify.export.approximate import approximate
from moeify.export.hf_export import EXPORTERS
from moeify.export.hf_parts import dense_form
from moeify.moe.experts.build import expert_mlp, moe_from_partition, shared_neuron_experts
from moeify.moe.experts.partition import ExpertPartition
from moeify.runtime.moe import MoeMLP
from moeify.runtime.routers import PrototypeRouter
from tests.helpers.tiny_models import tiny_model

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
# layer -> (shared neurons, experts x neurons each) of the 88: layer 0 keeps 82 per token, layer 1 34
LAYOUT = {0: (76, (6, 6)), 1: (16, (18, 18, 18, 18))}


def _router(hidden: int, experts: int) -> PrototypeRouter:
    router = PrototypeRouter(hidden, experts, top_k=1)
    router.prototypes.normal_(generator=torch.Generator().manual_seed(experts))
    return router


def wide_first_layer():
    """A tiny LLaMA whose layer 0 keeps most of its MLP for every token (a wide shared part), layer 1 few;
    the vocabulary of the test tokenizer (stories260K's), so that it reads text."""
    model = tiny_model("llama", vocab_size=512)
    adapter = DecoderAdapter(model)
    for i, (shared, experts) in LAYOUT.items():
        mlp = adapter.mlp(i)
        order = torch.randperm(mlp.intermediate_size, generator=torch.Generator().manual_seed(i))
        parts = torch.split(order, [shared, *experts, mlp.intermediate_size - shared - sum(experts)])
        partition = ExpertPartition(parts[0].sort().values, tuple(p.sort().values for p in parts[1:-1]))
        adapter.replace_mlp_(i, moe_from_partition(mlp, partition, _router(model.config.hidden_size, len(experts))))
    return model.eval()


def test_the_dense_form_is_every_expert_on_and_each_shared_neuron_once():
    model = tiny_model("llama")
    mlp = DecoderAdapter(model).mlp(0)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = moe_from_partition(mlp, ExpertPartition(torch.arange(20), (torch.arange(20, 50), torch.arange(50, 88))),
                               _router(model.config.hidden_size, 2))
    dense = dense_form(whole)
    assert dense.width == 88
    torch.testing.assert_close(dense(x), whole.forward_all_experts(x[None])[0], rtol=1e-5, atol=1e-6)
    # overlapping experts (ToMoE's, stored once): the union, not the sum
    overlapping = MoeMLP(shared_neuron_experts(mlp, [torch.arange(0, 40), torch.arange(30, 70)]),
                         _router(model.config.hidden_size, 2), None, None)
    union = dense_form(overlapping)
    assert union.width == 70
    torch.testing.assert_close(union(x), expert_mlp(mlp.select(torch.arange(70)))(x), rtol=1e-5, atol=1e-6)


def test_auto_makes_the_wide_layer_dense_where_the_format_has_dense_layers_of_their_own_width():
    model = wide_first_layer()
    qwen = EXPORTERS["qwen2_moe"]
    assert qwen.cheapest_dense_layers(model) == [0]
    assert EXPORTERS["glm4_moe"].cheapest_dense_layers(model) == [0]  # a leading dense layer
    # every layer routed, a dense one kept as a narrow shared part and its rest in every expert: 16 + 72
    # neurons per token in both layers against 80 + 24 with layer 0's shared part padded into layer 1
    assert EXPORTERS["granitemoeshared"].cheapest_dense_layers(model) == [0]
    # no shared part: each layer runs one expert as wide as its widest per-token set (88), dense or not
    assert EXPORTERS["mixtral"].cheapest_dense_layers(model) == []


def test_the_dense_export_computes_the_dense_form_and_costs_less(tokenizer, calib_text, eval_text):
    model = wide_first_layer()
    exact = EXPORTERS["qwen2_moe"].build(model).model
    approximation, parts = approximate(model, tokenizer, calib_text, eval_text, steps=1, seq_len=32,
                                       dense_layers="auto", fmt="qwen2_moe")
    assert approximation.dense_layers == {0} and parts["dense_layers"]["layers"][0]["dense_width"] == 88
    assert 0.5 < parts["dense_layers"]["held_out_agreement"] <= 1.0
    export = EXPORTERS["qwen2_moe"].build(model, approximation=approximation)
    config = export.model.config
    assert config.mlp_only_layers == [0] and config.intermediate_size == 88
    fmt = EXPORTERS["qwen2_moe"].format
    assert fmt.neurons_per_token(config) < fmt.neurons_per_token(exact.config)
    # the same function as the source with layer 0 replaced by its dense form
    reference = wide_first_layer()
    adapter = DecoderAdapter(reference)
    form = dense_form(adapter.mlp_module(0))
    adapter.mlp_module(0).forward = lambda h: form(h)
    with torch.no_grad():
        torch.testing.assert_close(export.model(IDS).logits, reference(IDS).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value, message", [("5", "layer 5 is not in [0, 1]"), ("x", "must be 'auto' or"),
                                            ("0,1", "no layer is routed"), ("0", "approximated: dense layers")])
def test_cli_dense_layers(value, message, tokenizer, tmp_path, capsys):
    native = moeify.save(ConversionResult(wide_first_layer(), tokenizer, {"method": "more"}), tmp_path / "native")
    code = main(["export", str(native), "--format", "qwen2_moe", "--out", str(tmp_path / "out"),
                 "--dense-layers", value])
    captured = capsys.readouterr()
    if value == "0":
        assert code == 0 and message in captured.out and "layer 0 dense" in captured.out
        assert "APPROXIMATE" in captured.out and "layout runs" not in captured.err  # no padding left to warn of
    else:  # refused in one line, without writing anything
        assert code == 2 and message in captured.err and not (tmp_path / "out").exists(), captured.err


def test_an_export_reports_the_neurons_per_token_its_layout_pads_to_and_warns_of_one_wide_layer(tokenizer, tmp_path,
                                                                                                 capsys):
    native = moeify.save(ConversionResult(wide_first_layer(), tokenizer, {"method": "more"}), tmp_path / "native")
    assert main(["export", str(native), "--format", "mixtral", "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    record = json.loads((tmp_path / "out" / "moeify_export.json").read_text())
    # converted: 76 + 6 neurons per token in layer 0, 16 + 18 in layer 1; mixtral: one expert width for both
    # layers, layer 0's 82 rounded up to 88
    assert record["mlp_neurons_per_token"] == {"source": 116.0, "export": 176}
    assert "116 as converted -> 176 in the mixtral layout" in captured.out
    assert "runs 1.52x the MLP neurons per token" in captured.err and "widest layer (0: 82" in captured.err
