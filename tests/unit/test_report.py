"""Reports read records only; compare matches budgets; bench prints both models' speed."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeify.api.compare import matched_options
from moeify.cli.main import main
from moeify.evaluation.record import read_conversion_record, read_record
from moeify.methods import get_method
from moeify.methods.cmoe.config import spec_for_share
from moeify.report.build import markdown_table, pareto_front

ROOT = Path(__file__).resolve().parents[2]


def test_pareto_front_keeps_the_undominated_points():
    points = [(0.5, 100.0), (0.45, 180.0), (0.8, 9.0), (0.5, 270.0), (0.9, 9.5)]
    assert pareto_front(points) == [0, 1, 2]


def test_cmoe_spec_for_a_budget():
    assert spec_for_share(0.25) == "S1A1E8"
    assert spec_for_share(0.5) == "S2A2E8"
    assert spec_for_share(1 / 3) == "S2A2E12"  # exact with 12 experts, not the near S5A6E32
    spec = spec_for_share(0.314)
    s, a, e = (int(x) for x in spec[1:].replace("A", " ").replace("E", " ").split())
    assert abs((s + a) / e - 0.314) < 0.01


def test_matched_options_follow_the_budget(stories):
    from moeify.arch import DecoderAdapter

    adapter = DecoderAdapter(stories[0])
    options, how = matched_options(get_method("static_prune"), 0.5, adapter)
    assert options == [{"active_ratio": 0.5}]
    options, _ = matched_options(get_method("more"), 0.6, adapter)
    assert options[0] == {"target_pr": pytest.approx(0.4)} and "layers" in options[1]
    assert matched_options(get_method("dsmoe"), 0.5, adapter)[0] == [{"active_ratio": 0.5}]  # tau after training
    budgetless = dataclasses.replace(get_method("dsmoe"), match_budget=None, unmatched="no budget option")
    assert matched_options(budgetless, 0.5, adapter) == ([{}], "not matched: no budget option")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two CLI conversions of stories260K with evaluation and speed measurement (~6 s)."""
    root = tmp_path_factory.mktemp("runs")
    for name, method, option in (("a", "cmoe", "spec=S1A1E8"), ("b", "static_prune", "active_ratio=0.6")):
        assert main(["convert", "--method", method, "--set", option, "--out", str(root / name)]) == 0
    return root


@pytest.mark.slow  # two_runs
def test_a_conversion_record_is_read_back_as_written(two_runs, tmp_path):
    """record.json is ``ConversionRecord.as_dict()``: read back, it is the same record; a record without a
    field that every conversion writes is refused with the field's name."""
    raw = read_record(two_runs / "a")
    record = read_conversion_record(two_runs / "a")
    assert record.method == "cmoe" and record.recovery is None and record.as_dict() == raw
    del raw["metrics"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "record.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="not a conversion record \\(no metrics\\)"):
        read_conversion_record(tmp_path / "bad")


@pytest.mark.slow  # two_runs
def test_a_report_reads_records_without_importing_torch(two_runs, tmp_path):
    """``moeify report`` needs no model, so it starts at once: torch is never imported."""
    script = ("import sys; from moeify.cli.main import main; "
              f"code = main(['report', {str(two_runs / 'a')!r}, {str(two_runs / 'b')!r}, '--out', {str(tmp_path / 'r')!r}]); "
              "print(code, [m for m in ('torch', 'transformers') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(ROOT / "src")},
                            capture_output=True, text=True)
    assert result.stdout.splitlines()[-1] == "0 []", result.stdout + result.stderr


@pytest.mark.slow  # two_runs
def test_report_from_records(two_runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", str(two_runs / "a"), str(two_runs / "b"), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| a | cmoe |" in text and "| b | static_prune |" in text
    for name in ("pareto.png", "expert_load.png", "routing_jsd.png", "speedup.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    records = [json.loads((two_runs / n / "record.json").read_text()) for n in "ab"]
    for record, name in zip(records, "ab"):
        record["_name"] = name
    table = markdown_table(records)
    assert table.count("\n") == 4
    change = records[0]["metrics"]["ppl_change"]
    assert f"| {100 * change:+.2f} % +- {100 * records[0]['metrics']['ppl_change_stderr']:.2f} % |" in table
    del records[0]["metrics"]["ppl_change"]  # a record that predates the sampling error
    assert f"| {records[0]['metrics']['ppl']:.3f} | - |" in markdown_table(records)
    records[0]["nominal_active"] = None  # a data-dependent router (DSMoE's threshold) has no nominal APR
    assert f"| {records[0]['active']['apr']:.3f} | - |" in markdown_table(records)
    assert "differ in base model" not in text
    other = tmp_path / "other-text"  # run b as if evaluated on another text
    shutil.copytree(two_runs / "b", other)
    record = json.loads((other / "record.json").read_text())
    record["data"]["eval"] = {"name": "ptb.txt", "sha256": "0" * 64}
    (other / "record.json").write_text(json.dumps(record))
    assert main(["report", str(two_runs / "a"), str(other), "--out", str(tmp_path / "mixed")]) == 0
    assert "These runs differ in base model or evaluation text (2 settings)" in capsys.readouterr().out
    assert "- setting 2: embedded:stories260K, evaluated on ptb.txt (other-text)" in (tmp_path / "mixed" / "report.md").read_text()
    (tmp_path / "not-a-run").mkdir()
    assert main(["report", str(tmp_path / "not-a-run"), "--out", str(tmp_path / "r2")]) == 2
    assert "has no record.json" in capsys.readouterr().err


@pytest.mark.slow  # two_runs
def test_bench_measures_both_models_keeps_them_in_the_record_and_the_report_shows_them(two_runs, tmp_path,
                                                                                    capsys):
    run = tmp_path / "a"
    shutil.copytree(two_runs / "a", run)
    out = tmp_path / "bench.json"
    assert main(["bench", str(run), "--prefill", "1x32,2x16", "--decode", "1,2", "--prompt-len", "16",
                 "--new-tokens", "4", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(p["batch_size"], p["seq_len"]) for p in result["prefill"]] == [(1, 32), (2, 16)]
    assert [d["batch_size"] for d in result["decode"]] == [1, 2] and not result["compiled"]
    assert all(p["dense"] > 0 and p["moe"] > 0 and p["spread"]["moe"] >= 0
               for p in result["prefill"] + result["decode"])
    assert result["ideal_speedup"] > 1  # 25 % of the MLP active
    assert read_conversion_record(run).bench == {"eager": result}  # kept in the record, as the typed record reads it
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert "| a | eager (cpu) | 1x32: " in (tmp_path / "report" / "report.md").read_text()
    capsys.readouterr()
    assert main(["bench", str(run), "--prefill", "1x4096"]) == 2  # longer than the model's positions
    assert "prefill 1x4096 is longer than the model's" in capsys.readouterr().err
    for flags, message in ((["--prefill", "8by256"], "is not BATCHxTOKENS"), (["--new-tokens", "1"], ">= 2"),
                           (["--compile", "--dtype", "float32"], "--compile needs --dtype bfloat16")):
        assert main(["bench", str(run), *flags]) == 2
        assert message in capsys.readouterr().err


def test_compare_refuses_an_existing_out_resumes_complete_runs_of_its_options_and_replaces_only_its_own(
        tmp_path):
    from moeify.api.compare import run_comparison
    from moeify.files import OutputExistsError

    out = tmp_path / "cmp"
    own = {"static_prune": {"finetune_seq_len": "64"}}  # as --set gives it
    first = run_comparison(None, ["static_prune"], 0.5, out, options=own)
    record = out / "static_prune" / "record.json"
    written = record.stat().st_mtime_ns
    with pytest.raises(OutputExistsError, match=r"exists \(an earlier moeify output\); pass --overwrite"):
        run_comparison(None, ["static_prune"], 0.5, out)
    again = run_comparison(None, ["static_prune"], 0.5, out, resume=True, options=own)
    assert again[0]["resumed"] and again[0]["folder"] == first[0]["folder"]
    assert again[0]["options"] == first[0]["options"]  # what was asked, not the whole config
    assert record.stat().st_mtime_ns == written  # not converted again
    other = {"static_prune": {"finetune_seq_len": "32"}}  # a completed run of other options is converted again
    changed = run_comparison(None, ["static_prune"], 0.5, out, resume=True, options=other)
    assert "resumed" not in changed[0] and changed[0]["options"]["finetune_seq_len"] == "32"
    assert json.loads(record.read_text())["config"]["finetune_seq_len"] == 32
    (out / "cmoe").mkdir()  # a stale run of an earlier comparison
    (out / "cmoe" / ".moeify").write_text("written by moeify; --overwrite may replace this folder\n")
    (out / "notes.md").write_text("mine")  # a user's file among the runs
    run_comparison(None, ["static_prune"], 0.5, out, overwrite=True)
    assert not (out / "cmoe").exists() and record.is_file() and (out / "notes.md").read_text() == "mine"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="was not written by moeify"):
        run_comparison(None, ["static_prune"], 0.5, mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep"
