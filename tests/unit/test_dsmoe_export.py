"""DSMoE end to end: the CLI convert writes the model, the record with the analyses and the heatmap PNG;
save -> load gives identical logits; ``moeify eval --set tau=...`` re-thresholds the saved model."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.cli.main import main

pytestmark = pytest.mark.slow  # a DSMoE conversion of stories260K with training and analyses (~8 s)

FAST = ["--set", "steps=3", "--set", "seq_len=64", "--set", "batch_size=2", "--set", "checkpoint_every=2"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from importlib import resources

    runs = tmp_path_factory.mktemp("runs")
    text = resources.files("moeify.data").joinpath("tinystories_eval.txt").read_text()
    second = runs / "second_half.txt"  # a second held-out data set: one more row of the Fig. 3 heatmap
    second.write_text(text[len(text) // 2:])
    out = runs / "dsmoe"
    assert main(["convert", "--method", "dsmoe", "--out", str(out), "--no-speed", *FAST,
                 "--eval", str(resources.files("moeify.data").joinpath("tinystories_eval.txt")),
                 "--eval", str(second)]) == 0
    return out


def test_convert_writes_model_record_and_heatmap(converted):
    record = json.loads((converted / "record.json").read_text())
    assert record["method"] == "dsmoe" and record["config"]["tau"] == 0.5
    assert record["nominal_active"] is None  # a threshold router has no nominal expert count
    assert 0 < record["active"]["mlp_ratio"] <= 1
    analysis = record["details"]["analysis"]
    first = [row for row in analysis["tau_sweep"] if row["data"] == record["data"]["eval"]["name"]]
    assert [row["tau"] for row in first] == [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert len(analysis["tau_sweep"]) == 2 * len(first)  # Table 4 on each --eval file
    ratios = [row["mlp_ratio"] for row in first]
    assert ratios == sorted(ratios, reverse=True)  # a higher threshold never activates more
    per_file = analysis["activated_experts"]["per_file"]
    assert list(per_file) == ["tinystories_eval.txt", "second_half.txt"]  # one heatmap row per --eval file
    assert all(len(row) == 5 and all(0 <= x <= 8 for x in row) for row in per_file.values())
    assert record["data"]["eval"]["name"] == "tinystories_eval.txt"  # the metrics are the first file's
    assert analysis["heatmap"] in record["artifacts"]
    assert (converted / analysis["heatmap"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["details"]["training"]["steps"] == 3
    assert not converted.with_name("dsmoe.work").exists()  # checkpoints removed once the model is saved
    spec = json.loads((converted / "config.json").read_text())["moeify"]["layers"]
    assert {layer["router"]["kind"] for layer in spec.values()} == {"threshold"}


def test_save_then_load_gives_identical_logits(converted):
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    model, _ = moeify.load_model(converted)
    remote = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True).eval()
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(moeify.load(converted)(ids).logits, expected)
        assert torch.equal(remote(ids).logits, expected)


def test_eval_changes_the_threshold_at_run_time(converted, tmp_path):
    record = json.loads((converted / "record.json").read_text())
    runs = {}
    for tau in ("0.5", "0.0", "0.6", "1.0"):
        assert main(["eval", str(converted), "--set", f"tau={tau}", "--json", str(tmp_path / f"{tau}.json")]) == 0
        runs[tau] = json.loads((tmp_path / f"{tau}.json").read_text())
        assert runs[tau]["runtime_options"] == {"tau": tau}
    assert runs["0.5"]["ppl"]["tinystories_eval"] == pytest.approx(record["metrics"]["ppl"], rel=1e-6)
    assert runs["0.0"]["active"]["mlp_ratio"] == pytest.approx(1.0)
    ratios = [runs[tau]["active"]["mlp_ratio"] for tau in ("0.0", "0.5", "0.6", "1.0")]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < ratios[1] <= 1.0
    assert runs["0.6"]["ppl"]["tinystories_eval"] != runs["0.5"]["ppl"]["tinystories_eval"]  # another threshold


def test_bench_measures_a_threshold_router_without_a_nominal_count(converted):
    from moeify.evaluation.bench import benchmark_pair

    dense, _ = moeify.load_model(None)
    result = benchmark_pair(dense, moeify.load(converted), [(1, 16)], [1], prompt_len=16, new_tokens=2, repeats=1)
    assert result["ideal_speedup"] > 1  # from the routing measured on a batch: DSMoE has switched experts off
