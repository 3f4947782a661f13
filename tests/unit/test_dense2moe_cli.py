"""Dense2MoE through the command line: ``moeify analyze`` and ``moeify convert --method dense2moe``."""

import json
from dataclasses import replace

import pytest
import torch

import moeify
from moeify.cli.main import main
from moeify.evaluation.record import read_record
from moeify.methods.dense2moe import DENSE2MOE, Dense2moeConfig
from moeify.methods.dense2moe.convert import convert
from moeify.moe.accounting import removed_layers
from moeify.options import OptionError, build_config
from tests.helpers.tiny_models import tiny_model
from tests.helpers.weights import assert_same_weights


def test_analyze_writes_matrices_heatmaps_and_record(tmp_path, capsys):
    out = tmp_path / "similarity"
    assert main(["analyze", "--out", str(out), "--samples", "2", "--seq-len", "128"]) == 0
    assert "span: keep" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert names - {".moeify"} == {"layer_similarity.json", "layer_output_similarity.png", "mlp_input_similarity.png",
                     "record.json"}
    matrices = json.loads((out / "layer_similarity.json").read_text())
    record = read_record(out)
    assert record["similarity"] == matrices and matrices["tokens"] == 256
    for name in ("layer_output", "mlp_input"):
        m = torch.tensor(matrices[name])
        assert m.shape == (5, 5) and torch.allclose(m, m.T, atol=1e-5)
        assert torch.allclose(m.diagonal(), torch.ones(5), atol=1e-5) and (m < 0.999).sum() == 20
    spans = record["spans"]
    assert len(spans) == 10 and spans[0]["layer_output_similarity"] >= spans[-1]["layer_output_similarity"]
    assert (out / "layer_output_similarity.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["analyze", "--out", str(out)]) == 2  # refuses to clobber without --overwrite


def test_convert_records_selection_similarity_and_plots(tmp_path):
    out = tmp_path / "d2m"
    assert main(["convert", "--method", "dense2moe", "--out", str(out), "--no-speed", "--set", "steps=3",
                 "--set", "warmup=1", "--set", "calib_samples=2"]) == 0
    record = read_record(out)
    details = record["details"]
    [selection] = details["selection"]
    assert selection["removed"] == [selection["layer"] + 1]
    assert details["finetune"]["steps"] == 3 and len(details["similarity"]["layer_output"]) == 5
    assert {"layer_output_similarity.png", "mlp_input_similarity.png"} <= {p.name for p in out.iterdir()}
    assert record["active"]["apr"] == pytest.approx(0.8)  # 4 of 5 attentions, top-1 of 2 MLP copies
    assert record["active"]["total_params"] == 226_560  # stories260K's dense P_attn + P_mlp
    loaded = moeify.load(out)
    assert loaded.config.num_hidden_layers == 4 and removed_layers(loaded) == details["removed_layers"]


def test_resume_needs_a_work_folder_and_the_method_is_registered(make_ctx):
    ctx = make_ctx(tiny_model("llama", num_hidden_layers=3))
    with pytest.raises(OptionError, match="resume=true needs a work folder"):
        convert(ctx, build_config(Dense2moeConfig, {"resume": "true"}))
    assert main(["methods"]) == 0 and DENSE2MOE in moeify.methods.METHODS


def test_a_killed_fine_tuning_resumes_through_the_work_folder(make_ctx, tmp_path, monkeypatch):
    options = {"calib_samples": 2, "seq_len": 64, "steps": 4, "warmup": 1, "checkpoint_every": 2}

    def run(work_dir=None, **extra):
        ctx = replace(make_ctx(tiny_model("llama", num_hidden_layers=3, vocab_size=512)), work_dir=work_dir)
        return ctx, convert(ctx, build_config(Dense2moeConfig, {**options, **extra})).details

    reference, _ = run()
    calls = []
    original = torch.optim.AdamW.step

    def step_then_die(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third update: the checkpoint of step 2 is on disk
            raise KeyboardInterrupt("killed")
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "step", step_then_die)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path)
    resumed, details = run(tmp_path, resume="true")
    assert details["finetune"]["resumed_from"] == 2 and len(details["finetune"]["losses"]) == 4
    assert_same_weights(resumed.model, reference.model)
    with pytest.raises(ValueError, match=r"cannot resume .*\(steps: 4 -> 6\)"):  # the schedule depends on steps
        run(tmp_path, steps=6, resume="true")
