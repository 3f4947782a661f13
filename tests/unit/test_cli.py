"""The command line contract: convert, eval, methods, and clear errors before heavy work."""

import dataclasses
import importlib
import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeify.cli.main import main
from moeify.methods import METHODS

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
METHOD_PAGES = ROOT / "docs" / "methods"


def test_methods_lists_every_method_with_paper_and_options(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "cmoe:" in out and "arXiv:2502.04416" in out and "top_k" in out and "spec" in out


def methods_markdown(capsys, *name: str) -> str:
    assert main(["methods", "--markdown", *name]) == 0
    return capsys.readouterr().out


def test_one_method_prints_its_own_section_of_the_listing_and_the_markdown(capsys):
    """``moeify methods NAME`` is that method's part of the whole output (``recovery``, ``attention``: the
    options every method takes), so
    the pages that hold one section each hold, together, every option of every method."""
    from moeify.cli.methods_cmd import section_names

    names = section_names()
    assert names == [method.name for method in METHODS] + ["recovery", "attention"]
    assert "\n".join(methods_markdown(capsys, name) for name in names) == methods_markdown(capsys)
    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    for name in names:
        assert main(["methods", name]) == 0
        assert capsys.readouterr().out.rstrip("\n") in listing
    assert main(["methods", "--markdown", "nope"]) == 2
    assert "unknown method 'nope'; available: cmoe" in capsys.readouterr().err


def test_methods_markdown_has_a_table_row_for_every_option_of_every_method(capsys):
    from moeify.methods.attention_sparsity import AttentionSparsityOptions
    from moeify.training.recovery_options import RecoveryOptions

    *sections, recovery, attention = methods_markdown(capsys).split("### ")[1:]
    assert [section.split("\n", 1)[0] for section in sections] == [f"`{method.name}`" for method in METHODS]
    assert recovery.startswith("Recovery (every method)") and attention.startswith("Attention thresholds")
    for section, options in ((recovery, RecoveryOptions), (attention, AttentionSparsityOptions)):
        assert [row.split(" | ")[0][3:-1] for row in section.splitlines() if row.startswith("| `")] == \
            [f.name for f in dataclasses.fields(options)]
    for method, section in zip(METHODS, sections):
        assert method.paper in section and "| option | type | default | meaning |" in section
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        names = [row.split(" | ")[0][3:-1] for row in rows]
        shorthands = [shorthand.name for shorthand in method.config_cls.shorthands]  # e.g. CMoE's spec
        assert sorted(names) == sorted([f.name for f in dataclasses.fields(method.config_cls)] + shorthands)
        assert names[0] == dataclasses.fields(method.config_cls)[0].name or "finetune_steps" not in names[0]
        assert all(row.count(" | ") == 3 for row in rows), rows  # a bare | in a cell would add a column


@pytest.mark.parametrize("name", [method.name for method in METHODS] + ["recovery", "attention"])
def test_the_documented_method_options_are_the_generated_ones(name, capsys):
    page = METHOD_PAGES / ("index.md" if name in ("recovery", "attention") else f"{name}.md")
    text = page.read_text()
    start, end = f"<!-- methods:{name}:start -->\n", f"<!-- methods:{name}:end -->"
    assert text.count(start) == 1 and text.count(end) == 1, f"{page} needs one pair of {name} markers"
    block = text.split(start, 1)[1].split(end, 1)[0]
    assert block == methods_markdown(capsys, name), \
        f"{page.relative_to(ROOT)}'s options differ from the code: paste `moeify methods --markdown {name}` " \
        "between its markers"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "cmoe"
    assert main(["convert", "--method", "cmoe", "--out", str(out), "--set", "spec=S1A1E8"]) == 0
    return out


def test_bench_leaves_out_default_shapes_longer_than_the_model_and_keeps_its_results(converted, capsys):
    assert main(["bench", str(converted), "--decode", "1", "--new-tokens", "2", "--repeats", "1"]) == 0
    assert "prefill 1x2048 left out: longer than the model's 512 positions" in capsys.readouterr().out
    bench = json.loads((converted / "record.json").read_text())["bench"]["eager"]
    assert [(p["batch_size"], p["seq_len"]) for p in bench["prefill"]] == [(1, 256), (8, 256)]


def test_convert_writes_model_and_record(converted):
    record = json.loads((converted / "record.json").read_text())
    assert record["method"] == "cmoe"
    assert record["config"]["num_experts"] == 8 and record["config"]["top_k"] == 1
    metrics = record["metrics"]
    for key in ("dense_ppl", "ppl", "eval_tokens"):
        assert metrics[key] > 0
    assert metrics["ppl_change"] == pytest.approx(metrics["ppl"] / metrics["dense_ppl"] - 1)
    assert 0 < metrics["ppl_change_stderr"] < abs(metrics["ppl_change"])  # carving S1A1E8 costs more than noise
    assert record["active"]["mlp_ratio"] == pytest.approx(0.25, abs=0.01)
    assert 0 < record["active"]["apr"] < 1 and record["active"]["active_params"] < record["active"]["total_params"]
    assert record["timings"]["convert_s"] > 0 and record["speed"]["dense_tokens_per_s"] > 0
    assert record["speed"]["repeats"] == 5 and all(v >= 0 for v in record["speed"]["spread"].values())
    assert record["paper_ratio"]["kind"] == "ffn" and record["paper_ratio"]["value"] == record["active"]["mlp_ratio"]
    assert {"torch", "transformers", "moeify"} <= set(record["versions"])
    assert (converted / "model.safetensors").is_file() and (converted / "modeling_moeify.py").is_file()


def test_a_converted_folder_carries_a_model_card_with_the_hub_metadata(converted, tmp_path):
    from moeify.export.model_card import hub_id

    card = (converted / "README.md").read_text()
    front, body = card.split("---\n")[1:3]
    assert "library_name: transformers" in front and "- moe\n- moeify\n- cmoe\n" in front
    assert "base_model" not in front  # the embedded model has no hub id
    record = json.loads((converted / "record.json").read_text())
    assert f"{record['metrics']['dense_ppl']:.3f} -> {record['metrics']['ppl']:.3f}" in body
    assert f"| activated parameter ratio (APR) | {record['active']['apr']:.3f} |" in body
    (tmp_path / "org").mkdir()
    assert hub_id("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M" and hub_id("gpt2") == "gpt2"
    assert hub_id(str(tmp_path / "org")) is None and hub_id("./runs/x") is None and hub_id("embedded:x") is None


def test_eval_with_runtime_top_k(converted, tmp_path, capsys):
    record = json.loads((converted / "record.json").read_text())
    assert main(["eval", str(converted), "--json", str(tmp_path / "e.json")]) == 0
    first = json.loads((tmp_path / "e.json").read_text())
    assert first["ppl"]["tinystories_eval"] == pytest.approx(record["metrics"]["ppl"], rel=1e-6)
    assert main(["eval", str(converted), "--set", "top_k=7", "--json", str(tmp_path / "all.json")]) == 0
    every = json.loads((tmp_path / "all.json").read_text())
    assert every["active"]["mlp_ratio"] == pytest.approx(1.0)
    assert every["ppl"]["tinystories_eval"] == pytest.approx(record["metrics"]["dense_ppl"], rel=1e-4)
    assert "perplexity tinystories_eval" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["convert", "--method", "nope", "--out", "{tmp}/o"], "unknown method 'nope'; available: cmoe"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--set", "top_k=9"], "top_k=9 must be <= the routed"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--set", "spec=S8A1E8"], "num_shared=8 must be < num_experts=8"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--calib", "{tmp}/none.txt"], "does not exist"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--calib", "{tmp}/empty.txt"], "holds no text"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--set", "seq_len=4096"], "seq_len=4096 must be <= the model's context (512)"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--seq-len", "0"], "eval_seq_len=0 is out of range; allowed: [2, 512]"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--set", "bogus=1"], "unknown option(s) bogus"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/full"], "exists and was not written by moeify"),
    (["eval", "embedded:stories260K", "--set", "top_k=2"], "apply to converted models only"),
    (["eval", "embedded:stories260K", "--seq-len", "1024"], "seq_len=1024 is out of range; allowed: [2, 512]"),
    (["convert", "--method", "cmoe", "--out", "{tmp}/o", "--seq-len", "1024"], "eval_seq_len=1024 is out of range"),
    (["convert", "--method", "dsmoe", "--out", "{tmp}/o", "--fsdp"], "--fsdp shards training over processes: start"),
])
def test_bad_input_fails_early_with_a_clear_message(argv, message, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_same_calibration_and_evaluation_file_warns(tmp_path, capsys):
    from importlib import resources

    calib = str(resources.files("moeify.data").joinpath("tinystories_calib.txt"))
    out = tmp_path / "o"
    assert main(["convert", "--method", "cmoe", "--out", str(out), "--calib", calib, "--eval", calib,
                 "--no-speed"]) == 0
    assert "warning: the calibration and evaluation texts are identical" in capsys.readouterr().err
    assert json.loads((out / "record.json").read_text())["warnings"]


def test_a_second_convert_into_the_same_out_is_refused_before_any_work(tmp_path, capsys):
    import os

    from moeify.files import output_lock

    out = tmp_path / "run"
    with output_lock(out):  # as a first convert holds it
        assert main(["convert", "--method", "cmoe", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"is being written by process {os.getpid()}" in err and not out.exists()


@pytest.mark.slow  # a real convert in a fresh process, interrupted by a real signal
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_training_names_its_last_checkpoint_and_the_resume_command(signum, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "moeify.cli.main", "convert", "--method", "dsmoe", "--out", str(out),
               "--no-speed", "--set", "steps=500", "--set", "checkpoint_every=1", "--set", "seq_len=32",
               "--set", "batch_size=2", "--set", "analyses=false"]
    # SIGINT as a terminal sends it, whatever this process inherited (a background shell job ignores it)
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    work = tmp_path / "run.work"
    deadline = time.monotonic() + 120
    while not list(work.glob("*/step-*")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("moeify convert: interrupted; the last checkpoint is ") and "Traceback" not in err
    assert last.endswith("--set resume=true") and f"--out {out}" in last
    assert not out.exists() and not (tmp_path / "run.lock").exists()


def test_the_resume_hint_asks_for_resume_once(tmp_path):
    from argparse import Namespace

    from moeify.cli.main import _resume_hint

    (tmp_path / "run.work" / "dsmoe_checkpoints" / "step-00000003").mkdir(parents=True)
    argv = ["convert", "--method", "dsmoe", "--out", str(tmp_path / "run")]
    for sets in ([], ["resume=true"]):  # a first run, then a resumed one stopped again
        given = [*argv, *(arg for pair in sets for arg in ("--set", pair))]
        hint = _resume_hint(Namespace(command="convert", out=tmp_path / "run", set=sets), given)
        assert "(step 00000003)" in hint and hint.endswith("--set resume=true") and hint.count("resume=true") == 1
    (tmp_path / "run.work" / "recovery_checkpoints" / "step-00000002").mkdir(parents=True)  # then a recovery
    hint = _resume_hint(Namespace(command="convert", out=tmp_path / "run", set=[]), argv)
    assert "(step 00000002)" in hint and hint.endswith("--set resume=true --set recover_resume=true")
    hint = _resume_hint(Namespace(command="recover", out=tmp_path / "run", set=[]), ["recover", "r"])
    assert hint.endswith("moeify recover r --set recover_resume=true")


@pytest.mark.parametrize("flags,message", [
    (["--decode", "0"], r"--decode='0' is out of range; allowed: integers >= 1"),
    (["--decode", "one"], r"must be comma-separated integers"),
    (["--prefill", "8x0"], r"'8x0' is not BATCHxTOKENS with both >= 1"),
    (["--repeats", "0"], r"--repeats=0 is out of range"),
    (["--new-tokens", "1"], r"--new-tokens=1 is out of range; allowed: >= 2"),
    (["--compile", "--dtype", "float16"], r"--compile needs --dtype bfloat16, not float16"),
])
def test_bench_refuses_bad_shapes_before_loading(flags, message, tmp_path, capsys):
    assert main(["bench", str(tmp_path), *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_eval_warns_when_the_perplexity_rests_on_few_tokens(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("Once upon a time there was a cat.")
    assert main(["eval", "embedded:stories260K", "--data", str(tmp_path / "short.txt"), "--seq-len", "64"]) == 0
    assert "warning: the perplexity of short.txt rests on" in capsys.readouterr().err


def test_debug_shows_the_traceback_that_the_one_line_error_hides(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder or file"):
        main(["--debug", "eval", str(tmp_path / "nowhere" / "model")])


def _docs_tables():
    """``benchmarks/docs_tables.py``, the one script that writes every table of figures from its results file."""
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass reads its own module
    spec.loader.exec_module(module)
    return module


DOCS_TABLES = _docs_tables()


@pytest.mark.parametrize("table", DOCS_TABLES.TABLES, ids=lambda table: table.name)
def test_every_table_of_figures_is_what_its_benchmark_prints_from_its_results(table):
    text = (ROOT / table.page).read_text()
    start, end = table.markers()
    assert text.count(start) == 1 and text.count(end) == 1, f"{table.page} needs one pair of {table.name} markers"
    assert table.block() == table.printed(), \
        f"{table.page}'s {table.name} differs from its results: run python benchmarks/docs_tables.py"


def test_every_generated_block_of_the_docs_has_its_generator():
    """A block between markers is either a method's options (``moeify methods``) or a table of
    ``docs_tables.TABLES``: none is pasted by hand and forgotten."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    markers = {(str(page.relative_to(ROOT)), name) for page in pages
               for name in re.findall(r"<!-- ([\w.:-]+):start -->", page.read_text())}
    tables = {(table.page, table.name) for table in DOCS_TABLES.TABLES}
    assert {m for m in markers if not m[1].startswith("methods")} == tables


def test_no_command_writes_into_what_it_reads(converted, tmp_path, capsys):
    """An output that is, holds or lies inside an input is refused before any work, --overwrite or not, and
    the input is left as it was."""
    data = tmp_path / "n.txt"
    data.write_text("Once upon a time there was a little dog. " * 40)
    weights = (converted / "model.safetensors").read_bytes()
    for argv in (["report", str(converted), "--out", str(converted), "--overwrite"],
                 ["report", str(converted), "--out", str(converted / "report")],
                 ["export", str(converted), "--format", "qwen2_moe", "--out", str(converted), "--overwrite"],
                 ["convert", str(converted), "--method", "cmoe", "--out", str(converted.parent), "--overwrite"],
                 ["eval", str(converted), "--data", str(data), "--json", str(data), "--overwrite"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "which this command reads" in err and err.count("\n") == 1, argv
    assert (converted / "model.safetensors").read_bytes() == weights
    assert data.read_text().startswith("Once upon a time")


def test_eval_json_refuses_an_existing_file_or_a_folder_before_evaluating(converted, tmp_path, capsys):
    existing = tmp_path / "results.json"
    existing.write_text("keep")
    assert main(["eval", str(converted), "--json", str(existing)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err and existing.read_text() == "keep"
    assert main(["eval", str(converted), "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["eval", str(converted), "--json", str(existing), "--overwrite"]) == 0
    assert json.loads(existing.read_text())["ppl"]


def test_inputs_that_are_not_what_they_seem_are_one_line_before_any_work(converted, tmp_path, capsys, monkeypatch):
    """A converted folder given to convert, a mistyped run path (never sent to the hub), a folder or a binary
    file as text: each one line naming it, exit code 2."""
    monkeypatch.chdir(converted.parent.parent)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\0" * 20_000)
    for argv, message in (
            (["convert", str(converted), "--method", "cmoe", "--out", str(tmp_path / "o")],
             "moeify converted this model already (cmoe); convert the dense model it came from"),
            (["eval", f"{converted.parent.name}/cmeo"], "no such model folder or file"),
            (["eval", str(converted), "--data", str(tmp_path)], "is a folder; name one .txt, .jsonl or .json file"),
            (["eval", str(converted), "--data", str(nul)], "is not text: 20000 of its 20000 characters are control")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "o").exists()


def test_a_full_disk_during_the_save_is_one_line_and_leaves_no_output(tmp_path, capsys, monkeypatch):
    import errno

    from moeify import files

    def full(folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    monkeypatch.setattr(files, "write_marker", full)
    out = tmp_path / "run"
    assert main(["convert", "--method", "static_prune", "--out", str(out), "--no-speed"]) == 1
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "error" in line.lower()]
    assert line.startswith("moeify convert: error: No space left on device (") and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary folder


def test_a_calibration_text_too_short_for_the_method_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    convert_use_case = importlib.import_module("moeify.api.convert")  # the module, not the function it exports

    def loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(convert_use_case, "load_model", loading)
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.")
    assert main(["convert", "--method", "cmoe", "--calib", str(short), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "short.txt: 18 tokens at most, fewer than the 8 windows of seq_len=512 (4096 tokens)" in err, err
    assert not (tmp_path / "o").exists()


def test_an_output_disk_without_room_for_the_model_is_refused_before_the_model_loads(converted, tmp_path, capsys,
                                                                                   monkeypatch):
    import shutil

    convert_use_case = importlib.import_module("moeify.api.convert")

    def loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(convert_use_case, "load_model", loading)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    assert main(["convert", "--method", "cmoe", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error: --out" in err and "the converted model needs about 0.00 GiB" in err and "has 0.00 GiB free" in err
    assert main(["recover", str(converted), "--tokens", "64", "--out", str(tmp_path / "r")]) == 2
    assert "the recovered model (as large as the conversion's weights) needs about" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_compare_names_the_command_that_continues_it(tmp_path):
    from moeify.cli.main import _resume_hint, build_parser

    argv = ["compare", "--methods", "cmoe,tomoe", "--out", str(tmp_path / "cmp")]
    hint = _resume_hint(build_parser().parse_args(argv), argv)
    assert hint.endswith(f"continues from its last checkpoint with: moeify compare --methods cmoe,tomoe --out {tmp_path / 'cmp'} --resume")
