"""Models held one decoder layer at a time (``moeify.offload``, ``--layer-by-layer``): the layers stay on the
meta device until a pass reads them, and a layer-by-layer conversion, its perplexities and its saved folder
equal those of the same conversion of the whole model in memory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import moeify
from moeify.calibration.data import EMBEDDED_EVAL, read_text
from moeify.calibration.observers import CoActivation
from moeify.cli.main import main
from moeify.evaluation.perplexity import perplexity
from moeify.offload import layered_of
from moeify.offload.checkpoint import INDEX_FILE
from moeify.options import OptionError
from tests.helpers.conversion import FAST
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model

LAYERED_METHODS = ("cmoe", "more", "static_prune", "random_split", "teal")
IDS = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(3))


def save_checkpoint(folder, tokenizer, family: str = "llama", **overrides):
    """A tiny model saved in bfloat16 across several safetensors shards, with the embedded tokenizer."""
    model = tiny_model(family, **STORIES_VOCAB, num_hidden_layers=3, **overrides).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder, max_shard_size="60KB")
    tokenizer.save_pretrained(folder)
    assert (folder / INDEX_FILE).is_file()
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    return save_checkpoint(tmp_path_factory.mktemp("sharded"), tokenizer)


@pytest.mark.parametrize("tied", [False, True])
def test_a_layered_model_holds_no_layer_and_scores_as_the_whole_one(tmp_path, tokenizer, tied):
    folder = save_checkpoint(tmp_path, tokenizer, tie_word_embeddings=tied)
    whole, _ = moeify.load_model(folder)
    layered, _ = moeify.load_model(folder, layer_by_layer=True)
    layers = layered_of(layered).adapter.layers
    assert all(p.is_meta for p in layers.parameters())
    assert not any(p.is_meta for name, p in layered.named_parameters() if ".layers." not in name)
    assert next(layered.get_input_embeddings().parameters()).dtype == torch.bfloat16
    text = read_text(EMBEDDED_EVAL)
    expected, got = perplexity(whole, tokenizer, text, 64), perplexity(layered, tokenizer, text, 64)
    assert got.ppl == expected.ppl and got.tokens == expected.tokens
    assert all(p.is_meta for p in layers.parameters())  # the pass gave every layer back


@pytest.mark.parametrize("method", LAYERED_METHODS)
def test_a_layer_by_layer_conversion_equals_the_whole_model_one(checkpoint, tmp_path, method):
    options = FAST[method] if method in FAST else {"sparsity": 0.4, "calib_samples": 4, "seq_len": 64}
    common = dict(eval_seq_len=64, measure_speed=False)
    whole = moeify.convert(checkpoint, method, options, **common)
    layered = moeify.convert(checkpoint, method, options, layer_by_layer=True, work_dir=tmp_path / "work", **common)
    for key in ("dense_ppl", "ppl", "eval_tokens"):
        assert layered.record["metrics"][key] == whole.record["metrics"][key]
    assert layered.record["active"] == whole.record["active"]
    assert layered.record["config"]["layer_by_layer"] and layered.record["speed"] is None
    moeify.save(layered, tmp_path / "out")
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) == 1 + 3  # the weights outside the layers, then one file per layer
    loaded = moeify.load(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, whole.model(IDS).logits)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "gpt_neox"])
def test_layer_by_layer_works_across_families(tmp_path, tokenizer, family):
    """Biases, scaled and tied embeddings, fused projections, parallel residuals, a final norm of another name."""
    folder = save_checkpoint(tmp_path / "ckpt", tokenizer, family)
    common = dict(eval_seq_len=64, measure_speed=False)
    whole = moeify.convert(folder, "cmoe", FAST["cmoe"], **common)
    layered = moeify.convert(folder, "cmoe", FAST["cmoe"], layer_by_layer=True, **common)
    assert layered.record["metrics"]["ppl"] == whole.record["metrics"]["ppl"]
    moeify.save(layered, tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(moeify.load(tmp_path / "out")(IDS).logits, whole.model(IDS).logits)


def test_a_saved_conversion_evaluates_layer_by_layer(checkpoint, tmp_path):
    result = moeify.convert(checkpoint, "more", FAST["more"], eval_seq_len=64, measure_speed=False)
    moeify.save(result, tmp_path / "out")
    text = read_text(EMBEDDED_EVAL)
    layered, tokenizer = moeify.load_model(tmp_path / "out", layer_by_layer=True)
    assert perplexity(layered, tokenizer, text, 64).ppl == result.record["metrics"]["ppl"]


def test_methods_that_need_the_whole_model_are_refused_before_loading(checkpoint):
    with pytest.raises(OptionError, match="cannot convert layer by layer.*cmoe, more"):
        moeify.convert(checkpoint, "tomoe", FAST["tomoe"], layer_by_layer=True)
    with pytest.raises(OptionError, match="fine-tune trains the whole model"):
        moeify.convert(checkpoint, "static_prune", {**FAST["static_prune"], "finetune_steps": 2},
                       layer_by_layer=True)


def test_a_gguf_file_or_a_folder_without_safetensors_is_refused(tmp_path, checkpoint):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not GGUF"):
        moeify.load_model(gguf, layer_by_layer=True)
    empty = tmp_path / "config_only"
    empty.mkdir()
    (empty / "config.json").write_text((checkpoint / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (empty / name).write_text((checkpoint / name).read_text())
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        moeify.load_model(empty, layer_by_layer=True)


def test_the_plan_of_a_layer_by_layer_conversion_holds_one_layer():
    whole = moeify.plan("llama-2-70b", "static_prune", eval_seq_len=512)
    layered = moeify.plan("llama-2-70b", "static_prune", eval_seq_len=512, layer_by_layer=True)
    assert layered.layer_by_layer and layered.peak < whole.peak / 20
    parts = layered.phases["convert"]
    assert parts["one layer, read and converted"] == 2 * 2 * layered.shape.layer_params
    assert parts["weights outside the layers"] == 2 * (layered.shape.params - layered.shape.decoder_params)


def test_the_cli_converts_layer_by_layer(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(checkpoint), "--method", "static_prune", "--set", "calib_samples=4",
                 "--set", "seq_len=64", "--seq-len", "64", "--layer-by-layer", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "not measured (layer by layer" in printed
    assert json.loads((out / "record.json").read_text())["config"]["layer_by_layer"] is True
    assert not (tmp_path / "out.work").exists()


def test_coactivation_counts_restricted_to_channels_match_the_float64_matrix():
    stats = CoActivation(hidden_size=3, width=6, k_act=2)
    h = torch.randn(50, 6, generator=torch.Generator().manual_seed(0))
    stats.update(torch.randn(50, 3), h)
    channels = torch.tensor([0, 2, 3, 5])
    expected = stats.coactivation[channels][:, channels].numpy().copy()
    np.fill_diagonal(expected, 0.0)
    assert np.array_equal(stats.coactivation_among(channels), expected)


def test_the_cli_evaluates_a_saved_conversion_layer_by_layer(checkpoint, tmp_path, capsys):
    result = moeify.convert(checkpoint, "cmoe", FAST["cmoe"], eval_seq_len=64, measure_speed=False)
    moeify.save(result, tmp_path / "out")
    assert main(["eval", str(tmp_path / "out"), "--seq-len", "64", "--layer-by-layer",
                 "--json", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert list(evaluated["ppl"].values()) == [result.record["metrics"]["ppl"]]
    assert evaluated["active"]["apr"] == result.record["active"]["apr"]
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "out"), "--layer-by-layer", "--tasks", "piqa"]) == 2
    assert "--tasks needs the whole model" in capsys.readouterr().err
