"""Native export: atomic folders, and save -> load gives identical logits (moeify.load and
transformers' trust_remote_code path) for every family."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeify
from moeify.api import ConversionResult
from moeify.files import OutputExistsError, atomic_dir
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.moe.accounting import moe_layers
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
    convert(ctx, CmoeConfig(spec="S1A2E8", calib_samples=4, seq_len=64))
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
    with pytest.raises(OutputExistsError, match="exists and is not empty; pass --overwrite"):
        with atomic_dir(out):
            pass
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
