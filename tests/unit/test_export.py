"""Native export: atomic folders, and save -> load gives identical logits (moeify.load and
transformers' trust_remote_code path) for every family."""

import json
import os
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import ConversionResult
from moeify.files import OutputExistsError, OutputLockedError, atomic_dir, atomic_file, check_output_dir, output_lock
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.arch import UnsupportedFamilyError
from moeify.moe.accounting import activated_parameters, moe_layers
from moeify.options import build_config
from tests.helpers.remote import logits_without_moeify
from tests.helpers.tiny_models import FAMILY_NAMES, STORIES_VOCAB, tiny_model

IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))


def model_dense_logits(family: str) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model(family, **STORIES_VOCAB)(IDS).logits


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_save_then_load_gives_identical_logits(family, make_ctx, tokenizer, tmp_path):
    model = tiny_model(family, **STORIES_VOCAB)
    ctx = make_ctx(model)
    convert(ctx, build_config(CmoeConfig, {"spec": "S1A2E8", "calib_samples": 4, "seq_len": 64}))
    with torch.no_grad():
        if family == "llama":  # non-trivial expert weights g = 1 + s'u must survive the round trip too
            torch.nn.init.normal_(moe_layers(ctx.model)[0].router.u)
        expected = ctx.model(IDS).logits
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "cmoe"}), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"moeify_{model.config.model_type}"
    assert len(config["moeify"]["layers"]) == 2
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    with torch.no_grad():
        assert torch.equal(moeify.load(out)(IDS).logits, expected)
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        assert type(remote).__module__.startswith("transformers_modules")
        assert torch.equal(remote(IDS).logits, expected)
        with pytest.raises(UnsupportedFamilyError, match=r"moeify\.load\(path\)"):
            activated_parameters(remote)  # its classes are copies moeify cannot inspect: the error says so
        loaded = moeify.load(out)
        for layer in moe_layers(loaded):
            layer.router.u.zero_()  # undo the perturbation above: unit weights again
        moeify.set_runtime_options(loaded, {"top_k": 7})
        torch.testing.assert_close(loaded(IDS).logits, model_dense_logits(family), atol=1e-4, rtol=0)


@pytest.mark.slow  # a fresh Python process loads transformers (~3 s)
def test_remote_code_needs_no_moeify(make_ctx, tokenizer, tmp_path):
    model = tiny_model("qwen2", **STORIES_VOCAB)
    ctx = make_ctx(model)
    convert(ctx, CmoeConfig(calib_samples=4, seq_len=64))
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "cmoe"}), tmp_path / "out")
    with torch.no_grad():
        expected = ctx.model(IDS).logits
    assert torch.equal(logits_without_moeify(out, IDS, tmp_path), expected)


def test_plain_loading_without_trust_remote_code_fails_loudly(make_ctx, tokenizer, tmp_path):
    ctx = make_ctx(tiny_model("llama", **STORIES_VOCAB))
    convert(ctx, CmoeConfig(calib_samples=4, seq_len=64))
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "cmoe"}), tmp_path / "out")
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)


def test_atomic_dir_leaves_nothing_on_failure_and_refuses_to_clobber(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half.bin").write_text("x")
            raise RuntimeError("killed")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(out) as tmp:
        (tmp / "done.txt").write_text("ok")
    assert (out / "done.txt").read_text() == "ok"
    with pytest.raises(OutputExistsError, match=r"exists \(an earlier moeify output\); pass --overwrite"):
        with atomic_dir(out):
            pass
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == [".moeify", "new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_overwrite_replaces_only_what_moeify_wrote(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("my sources")
    with pytest.raises(OutputExistsError, match="was not written by moeify .* choose another --out"):
        with atomic_dir(project, overwrite=True):
            pass
    assert (project / "train.py").read_text() == "my sources"  # nothing lost


def test_an_output_under_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    with pytest.raises(OutputExistsError, match=r"is not writable \(Not a directory\)"):
        check_output_dir(tmp_path / "notes.txt" / "out", overwrite=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_output_is_refused_before_any_work(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputExistsError, match="is not writable"):
            check_output_dir(locked / "sub" / "out", overwrite=False)
    finally:
        locked.chmod(0o700)


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "out" / "model.safetensors").stat().st_mode) == 0o644


def test_a_second_writer_of_the_same_output_is_refused_with_the_first_ones_pid(tmp_path):
    out = tmp_path / "run"
    with output_lock(out):
        with pytest.raises(OutputLockedError, match=rf"is being written by process {os.getpid()} "):
            with output_lock(out):
                pass
    (tmp_path / "run.lock").write_text("999999999\nmoeify convert (killed)\n")  # a dead holder
    with output_lock(out):
        assert (tmp_path / "run.lock").read_text().startswith(str(os.getpid()))
    assert not (tmp_path / "run.lock").exists()


def test_loading_a_converted_folder_needs_no_remote_code_for_its_tokenizer(make_ctx, tokenizer, tmp_path, capfd):
    model = tiny_model("llama", **STORIES_VOCAB)
    ctx = make_ctx(model)
    convert(ctx, build_config(CmoeConfig, {"spec": "S1A2E8", "calib_samples": 4, "seq_len": 64}))
    out = moeify.save(ConversionResult(ctx.model, tokenizer, {"method": "cmoe"}), tmp_path / "out")
    capfd.readouterr()
    loaded, loaded_tokenizer = moeify.load_model(out)
    err = capfd.readouterr().err
    assert "not supported" not in err and "custom code" not in err, err
    assert loaded_tokenizer("Once upon a time").input_ids == tokenizer("Once upon a time").input_ids


def test_overwrite_needs_moeify_s_own_marker_and_keeps_the_files_moeify_did_not_write(tmp_path):
    """A record.json or a hand-made marker is no proof that moeify wrote a folder; in a folder it did write,
    --overwrite replaces moeify's files and keeps those a user added."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "thesis.txt").write_text("mine")
    (fake / "record.json").write_text("{}")
    (fake / ".moeify").write_text('{"written_by": "moeify convert", "files": {}, "digest": "0"}')
    with pytest.raises(OutputExistsError, match="was not written by moeify"):
        with atomic_dir(fake, overwrite=True):
            pass
    assert (fake / "thesis.txt").read_text() == "mine"
    out = tmp_path / "run"
    with atomic_dir(out, command="report") as tmp:
        (tmp / "report.md").write_text("old")
    assert json.loads((out / ".moeify").read_text())["written_by"] == "moeify report"
    (out / "notes.md").write_text("my notes")
    (out / "sub").mkdir()
    (out / "sub" / "more.txt").write_text("more")
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "report.md").write_text("new")
    assert (out / "report.md").read_text() == "new" and (out / "notes.md").read_text() == "my notes"
    assert (out / "sub" / "more.txt").read_text() == "more"
    (out / "plot.png").write_text("a user's file where the next output writes one")
    with pytest.raises(OutputExistsError, match="holds 'plot.png', which moeify did not write"):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "plot.png").write_text("new plot")
    assert (out / "plot.png").read_text().startswith("a user's file") and (out / "report.md").read_text() == "new"
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / ".moeify").write_text("written by moeify; --overwrite may replace this folder\n")
    (legacy / "old.bin").write_text("x")
    with atomic_dir(legacy, overwrite=True) as tmp:
        (tmp / "new.bin").write_text("y")
    assert sorted(p.name for p in legacy.iterdir()) == [".moeify", "new.bin"]


def test_a_killed_write_s_temporaries_are_removed_by_the_next_write_of_that_output(tmp_path):
    """A save killed mid-way leaves ``.NAME.tmp-XXXXXXXX`` beside its output; the next write of that output
    (which holds the output's lock) removes it, and nothing else: not another output's, not a user's file."""
    stale, stale_file = tmp_path / ".run.tmp-ab12cd_3", tmp_path / ".metrics.json.tmp-9xk2m1q0"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    stale_file.write_text("{")
    kept = [tmp_path / ".other.tmp-ab12cd_3", tmp_path / ".run.tmp-mine", tmp_path / "run.tmp-ab12cd_3"]
    for path in kept:
        path.write_text("not this run's")
    with atomic_dir(tmp_path / "run") as tmp:
        (tmp / "done.txt").write_text("ok")
    with atomic_file(tmp_path / "metrics.json") as tmp:
        tmp.write_text("{}")
    assert not stale.exists() and not stale_file.exists()
    assert all(path.read_text() == "not this run's" for path in kept)
