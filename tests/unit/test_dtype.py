"""Working dtypes: a bfloat16 model converts to a bfloat16 model with every method, the identities hold in
bfloat16 within a stated tolerance, and --dtype reaches the saved weights and the record."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import moeify
from moeify.api import ConversionResult
from moeify.cli.main import main
from moeify.loading import working_dtype
from moeify.methods import METHODS
from moeify.moe.accounting import moe_layers
from moeify.options import build_config
from tests.helpers.conversion import FAST, clone, conversion_context
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model

IDS = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(7))
# bfloat16 keeps 8 bits of mantissa: summing an MLP's output over experts in another order than the dense
# matmul moves logits (of size ~1-5 here) by a few 1e-2.
BF16_ATOL = 0.1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A float32 tiny LLaMA saved as a checkpoint folder, loaded in bfloat16 the way users load one."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", **STORIES_VOCAB).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bf16_model(folder):
    model, _ = moeify.load_model(folder, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    return model


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_method_converts_bfloat16_to_bfloat16_and_it_reloads_identically(method, checkpoint, tokenizer,
                                                                                calib_text, tmp_path):
    model = bf16_model(checkpoint)
    rotary = {name: b.dtype for name, b in model.named_buffers() if "rotary" in name}
    config = build_config(method.config_cls, FAST.get(method.name, {}))
    method.check(config, model.config)
    torch.manual_seed(0)
    method.run(conversion_context(model, tokenizer, calib_text), config)
    float32 = {f"{path}.{attr}" for path, module in model.named_modules()  # e.g. TEAL's thresholds
               for attr in getattr(module, "float32_buffers", ())}
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    floats |= {b.dtype for name, b in model.named_buffers()
               if b.is_floating_point() and name not in rotary and name not in float32}
    assert floats == {torch.bfloat16}
    assert {b.dtype for name, b in model.named_buffers() if name in float32} <= {torch.float32}
    assert {name: b.dtype for name, b in model.named_buffers() if "rotary" in name} == rotary  # kept as loaded
    with torch.no_grad():
        logits = model.eval()(IDS).logits
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
        folder = moeify.save(ConversionResult(model, tokenizer, {"method": method.name}), tmp_path / "m")
        reloaded = moeify.load(folder)
        assert next(reloaded.parameters()).dtype == torch.bfloat16  # the dtype it was saved in
        torch.testing.assert_close(reloaded(IDS).logits, logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["cmoe", "random_split"])
def test_every_expert_on_reproduces_the_dense_bfloat16_model(name, checkpoint, make_ctx):
    method = next(m for m in METHODS if m.name == name)
    dense = bf16_model(checkpoint)
    moe = clone(dense)
    method.run(make_ctx(moe), build_config(method.config_cls, {**FAST[name], "spec": "S1A1E8"}))
    with torch.no_grad():
        reference = dense(IDS).logits.float()
        assert (moe(IDS).logits.float() - reference).abs().max() > 10 * BF16_ATOL  # top-1 of 7 drops neurons
        for layer in moe_layers(moe):
            layer.router.set_option("top_k", 7)
        torch.testing.assert_close(moe(IDS).logits.float(), reference, atol=BF16_ATOL, rtol=0)


def test_the_working_dtype_defaults_to_the_checkpoints_own():
    config = tiny_model("llama").config
    config.dtype = "bfloat16"
    assert working_dtype(None, config) == torch.bfloat16
    assert working_dtype("float16", config) == torch.float16
    assert working_dtype(None, None) == torch.float32  # GGUF: quantised weights, no float dtype of their own
    with pytest.raises(ValueError, match="dtype='int8' is not a working dtype; allowed: float32, bfloat16, float16"):
        working_dtype("int8", config)


def test_dtype_on_the_command_line_reaches_the_weights_and_the_record(tmp_path):
    out = tmp_path / "m"
    assert main(["convert", "--method", "static_prune", "--set", "calib_samples=4", "--dtype", "bfloat16",
                 "--no-speed", "--out", str(out)]) == 0
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16", "I64"}  # weights; kept-channel indices
    assert json.loads((out / "record.json").read_text())["config"]["dtype"] == "bfloat16"
    assert main(["eval", str(out), "--dtype", "float32", "--json", str(tmp_path / "eval.json")]) == 0
    assert json.loads((tmp_path / "eval.json").read_text())["ppl"]


@pytest.mark.parametrize("name,options", [("tomoe", {"frozen_weights": "float32"}),
                                          ("tomoe", {"frozen_weights": "working"}),
                                          ("dsmoe", {"steps": 3})])
def test_training_in_bfloat16_takes_the_float32_conversions_steps(name, options, checkpoint, tokenizer, calib_text):
    """ToMoE's frozen weights are held in float32 while it trains (the default), DSMoE trains float32
    masters and fits its gates' start in float32: a bfloat16 conversion then takes the float32
    conversion's steps exactly (a bfloat16 number is a float32 one) and ends as its model rounded to
    bfloat16. Under bfloat16 autocast (ToMoE's ``working``) the steps differ from the first."""
    method = next(m for m in METHODS if m.name == name)
    config = build_config(method.config_cls, {**FAST[name], **options})
    models, losses = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = bf16_model(checkpoint)  # rotary frequencies float32, as loaded (a .to(bfloat16) would round them)
        models[dtype] = model.float() if dtype == torch.float32 else model
        details = method.run(conversion_context(models[dtype], tokenizer, calib_text), config).details
        losses[dtype] = details["training"]["losses"]
    if options.get("frozen_weights") == "working":
        assert losses[torch.bfloat16][0] != losses[torch.float32][0]
        return
    assert losses[torch.bfloat16] == losses[torch.float32]
    low = models[torch.bfloat16].state_dict()
    for name, value in models[torch.float32].state_dict().items():
        assert torch.equal(value.to(low[name].dtype), low[name]), name
