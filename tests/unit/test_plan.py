"""``moeify plan``: peak-memory estimates from a config alone, and the check ``convert`` makes before loading."""

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moeify
from moeify.cli.main import main
from moeify.cli.plan_cmd import table
from moeify.memory_plan import plan
from moeify.methods import METHODS, get_method
from moeify.methods.cmoe import CmoeConfig
from moeify.options import OptionError
from moeify.planning import GIB, PRESETS, ModelShape
from tests.helpers.tiny_models import FAMILY_NAMES, tiny_model

ROOT = Path(__file__).resolve().parents[2]

plan_api = importlib.import_module("moeify.memory_plan")  # the module: ``moeify.memory_plan.plan`` is the function


def test_presets_are_the_published_shapes():
    assert {name: round(plan(name, "cmoe").shape.params / 1e9, 2) for name in PRESETS} == \
        {"llama-2-7b": 6.74, "llama-3-8b": 8.03, "llama-2-13b": 13.02, "llama-2-70b": 68.98}


def test_every_method_plans_its_phases_from_its_options():
    for method in METHODS:
        memory = plan("llama-2-7b", method.name)
        weights = 6.74e9 * 2
        assert memory.phases["evaluate dense"]["weights"] == pytest.approx(weights, rel=0.01)
        assert memory.peak > weights and memory.peak_phase in memory.phases
    cmoe = plan("llama-2-7b", "cmoe")
    assert plan("llama-2-7b", "cmoe", {"calib_samples": 32}).phases["convert"]["layer statistics"] > \
        cmoe.phases["convert"]["layer statistics"]
    assert plan("llama-2-7b", "cmoe", dtype="float32").peak > 1.9 * cmoe.phases["evaluate dense"]["weights"]
    dsmoe, tomoe = plan("llama-2-7b", "dsmoe"), plan("llama-2-7b", "tomoe")
    train = dsmoe.phases["train"]  # bfloat16 weights, float32 masters, gradients and AdamW moments
    assert dsmoe.peak_phase == "train" and train["optimizer"] == 4 * train["weights"] == 2 * train["trained copy"]
    assert dsmoe.work["calibration tokens x layers"] == 4 * 4096 * 32  # the margin start's fit: 4 d tokens per layer
    assert "convert" not in plan("llama-2-7b", "dsmoe", {"gate_init": "random"}).phases
    held = tomoe.phases["train"]["frozen weights in float32"]  # ToMoE's frozen weights float32 while it trains
    assert tomoe.phases["train"]["gradients"] < 0.05 * held and held == pytest.approx(6.74e9 * 4, rel=0.01)
    autocast = plan("llama-2-7b", "tomoe", {"frozen_weights": "working"})
    assert autocast.phases["train"]["weights"] == pytest.approx(6.74e9 * 2, rel=0.01)
    # float32 arithmetic (every weight trains, or ToMoE's held in float32): activations as in a float32
    # model; ToMoE under bfloat16 autocast: half of them
    for method, options, ratio in (("dsmoe", {}, 1), ("tomoe", {}, 1), ("tomoe", {"frozen_weights": "working"}, 2)):
        float32 = plan("llama-2-7b", method, options, dtype="float32").phases["train"]
        bf16 = plan("llama-2-7b", method, options).phases["train"]
        assert float32["activations"] == pytest.approx(ratio * bf16["activations"], rel=0.1)
    # ToMoE's experts overlap: N = 8 packed experts of p = 1/2 the MLP each, where CMoE's partition it
    packed = cmoe.phases["evaluate MoE"]["packed experts"]
    assert tomoe.phases["evaluate MoE"]["packed experts"] == pytest.approx(4 * packed, rel=1e-6)
    assert plan("llama-2-7b", "dsmoe", {"recompute": "false"}).phases["train"]["activations"] > \
        10 * dsmoe.phases["train"]["activations"]
    assert plan("llama-2-7b", "cmoe", {"finetune_steps": 10}).phases["train"]["gradients"] == 0  # LoRA: not counted
    assert plan(None, "cmoe").shape.name == "embedded:stories260K"


@pytest.mark.parametrize("method", ["cmoe", "static_prune", "random_split"])
def test_the_output_refit_is_planned_with_the_calibration_tokens_it_fits(method):
    """The refit holds every calibration token's routed hidden values: more tokens, more memory."""
    statistics = {samples: {refit: plan("llama-2-7b", method, {"calib_samples": samples, "refit_down": refit})
                            .phases["convert"]["layer statistics"] for refit in (False, True)}
                  for samples in (8, 16)}
    added = {samples: row[True] - row[False] for samples, row in statistics.items()}
    routed_hidden = 8 * 4096 * 11008 * 4  # H_m of 8 windows of 4096 tokens in float32
    assert added[8] > routed_hidden and added[16] > added[8] + routed_hidden


def test_sharded_training_splits_the_decoder_layers_training_state_among_the_processes():
    whole = plan("llama-2-7b", "dsmoe", device="cuda").phases["train"]
    sharded = plan("llama-2-7b", "dsmoe", device="cuda", shards=8)
    decoder = 32 * (4 * 4096**2 + 3 * 4096 * 11008)  # every LLaMA-2-7B parameter but embeddings and norms
    for part in ("gradients", "optimizer"):
        assert whole[part] - sharded.phases["train"][part] == pytest.approx(whole[part] * decoder / 6.74e9 * 7 / 8,
                                                                            rel=0.01)
    assert list(sharded.phases) == ["evaluate dense", "convert", "shard", "train", "evaluate MoE"]  # convert: gate fit
    shard = sharded.phases["shard"]  # bfloat16 model, float32 a layer at a time: far below a float32 copy
    assert sum(shard.values()) < whole["weights"] + whole["trained copy"] / 3
    assert sharded.peak < plan("llama-2-7b", "dsmoe", device="cuda").peak / 4
    tomoe = plan("llama-2-7b", "tomoe", device="cuda")  # frozen weights: planned as replicated
    assert plan("llama-2-7b", "tomoe", device="cuda", shards=8).phases == tomoe.phases


def test_convert_stops_before_loading_when_the_plan_does_not_fit(monkeypatch):
    monkeypatch.setattr(plan_api, "available_memory", lambda device: GIB // 1000)
    monkeypatch.setattr(importlib.import_module("moeify.api.convert"), "load_model",
                        lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(OptionError, match=r"needs about 0\.\d GiB at its peak \(evaluate MoE\), and cpu has "
                                          r"0\.0 GiB free; try --layer-by-layer \(one decoder layer in memory "
                                          r"at a time\), or --dtype bfloat16 .*a machine or device with more"):
        moeify.convert(None, "cmoe", measure_speed=False)
    assert main(["convert", "--method", "cmoe", "--out", "unused", "--no-speed"]) == 2


def test_a_tomoe_plan_that_does_not_fit_names_the_frozen_weights_in_the_working_dtype(monkeypatch):
    memory = plan("llama-2-7b", "tomoe", {"num_experts": 2}, device="cuda")  # few experts: training is the peak
    assert memory.peak_phase == "train"
    monkeypatch.setattr(plan_api, "available_memory", lambda device: memory.peak // 2)
    with pytest.raises(OptionError, match=r"frozen weights kept in the working dtype \(--set frozen_weights=working\)"):
        plan_api.check_fits(memory, "cuda")
    monkeypatch.setattr(plan_api, "available_memory", lambda device: 0)
    with pytest.raises(OptionError) as refused:
        plan_api.check_fits(plan("llama-2-7b", "tomoe", {"frozen_weights": "working"}, device="cuda"), "cuda")
    assert "frozen_weights" not in str(refused.value)


def test_conversion_records_its_plan_and_measured_peak():
    record = moeify.convert(None, "static_prune", measure_speed=False).record
    assert record["memory"]["plan_phase"] == "evaluate MoE"  # the pruned copies beside the mapped checkpoint
    assert 0 < record["memory"]["plan_gib"] < 2 and record["memory"]["peak_rss_gib"] > 0.1


def test_plan_cli_prints_phases_json_and_the_readme_table(capsys):
    assert main(["plan", "llama-2-70b", "--method", "more", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["params"] > 6.8e10 and record["dtype"] == "bfloat16" and record["peak_gib"] > 128
    assert set(record["phases_gib"]) == {"evaluate dense", "convert", "evaluate MoE"}
    assert main(["plan", "--method", "dsmoe", "--dtype", "float32"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["plan", "--table"]) == 0
    table = capsys.readouterr().out
    assert table.count("\n") == 6 and "| llama-3-8b | 8.03 B |" in table


def test_the_documented_plan_table_is_what_moeify_plan_prints():
    page = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    assert table() in page and table(layer_by_layer=True) in page


@pytest.mark.parametrize("layer_by_layer", [False, True])
def test_calibration_hidden_states_are_planned_in_float32_whatever_the_dtype(layer_by_layer):
    """``calibration.stream`` caches every calibration window's hidden states in float32."""
    states = {dtype: plan("llama-2-7b", "cmoe", dtype=dtype, layer_by_layer=layer_by_layer)
              for dtype in ("bfloat16", "float32")}
    tokens = states["float32"].work["calibration tokens x layers"] // 32
    for memory in states.values():
        assert memory.phases["convert"]["calibration hidden states"] == 2 * tokens * 4096 * 4


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_checkpoint_folder_is_planned_from_its_files_as_from_its_model(family, tmp_path):
    """``ModelShape.from_checkpoint`` (config.json and safetensors headers, no torch) counts what a model
    built from the config counts, tied embeddings and biases included."""
    model = tiny_model(family, tie_word_embeddings=family.startswith("gemma"))
    model.save_pretrained(tmp_path)
    read = ModelShape.from_checkpoint(tmp_path, "tiny")
    assert read == ModelShape.from_config(model.config, "tiny")
    assert plan(tmp_path, "cmoe").as_dict() == plan_api.method_plan(
        ModelShape.from_config(model.config, str(tmp_path)), get_method("cmoe"), CmoeConfig(), torch.float32,
        model.config.max_position_embeddings, "cpu", False).as_dict()


def test_moeify_plan_of_a_checkpoint_folder_answers_without_torch(tmp_path):
    """A command that needs no weights starts at once: ``moeify plan FOLDER`` reads two small files; the
    whole command (Python's start included) within the start-up budget of 3 s."""
    tiny_model("llama").save_pretrained(tmp_path)
    script = ("import sys, time; start = time.perf_counter(); from moeify.cli.main import main; "
              f"code = main(['plan', {str(tmp_path)!r}, '--method', 'dsmoe']); "
              "print(code, [m for m in ('torch', 'transformers') if m in sys.modules], time.perf_counter() - start)")
    begun = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(ROOT / "src")},
                            capture_output=True, text=True)
    seconds = time.perf_counter() - begun
    assert result.stdout.splitlines()[-1].startswith("0 []"), result.stdout + result.stderr
    assert "train" in result.stdout and seconds < 3.0


def test_a_sharded_checkpoint_is_counted_through_its_index_and_other_safetensors_are_not(tmp_path):
    model = tiny_model("mistral")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "consolidated.safetensors").write_bytes(next(tmp_path.glob("model-*.safetensors")).read_bytes())
    assert ModelShape.from_checkpoint(tmp_path, "tiny") == ModelShape.from_config(model.config, "tiny")
