"""SmolLM2-135M-Instruct as users hold it, a llama.cpp GGUF file: moeify loads it through transformers'
own GGUF reader, as a file or as the folder holding it, and the loaded model is an ordinary float model
that generates what the original does and saves like any other."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moeify.loading import load_model, model_source

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to"
CONTINUATION = " play with her friends, but one day, she found a magical box"  # ../shared/assets/MANIFEST.md


@pytest.fixture(scope="module")
def smollm2(shared_assets):
    folder = shared_assets / "models" / "smollm2-135m-instruct"
    return folder, load_model(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_a_gguf_file_or_its_folder_is_read_as_gguf(smollm2):
    folder, _ = smollm2
    assert model_source(folder) == model_source(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert model_source(folder).gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_dequantised_model_generates_the_original_continuation(smollm2):
    _, (model, tokenizer) = smollm2
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=14, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).startswith(CONTINUATION)


def test_it_matches_transformers_own_gguf_load_and_saves(smollm2, tmp_path):
    folder, (model, tokenizer) = smollm2
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                     dtype=torch.float32)
    ref_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = ref_tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(tokenizer(PROMPT, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    model.save_pretrained(tmp_path / "saved")  # transformers refuses this for its own GGUF load
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference(ids).logits)


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Small budgets: these tests check that every method converts the real model and that the folder loads,
# not quality (benchmarks/bench_real.py measures that).
SMALL = {
    "cmoe": {"calib_samples": 1, "seq_len": 128, "spec": "S2A2E16"},
    "random_split": {"calib_samples": 1, "seq_len": 128},
    "more": {"calib_samples": 1, "seq_len": 128},
    "tomoe": {"steps": 1, "batch_size": 1, "seq_len": 64, "calib_samples": 1, "checkpoint_every": 0},
    "dsmoe": {"steps": 1, "batch_size": 1, "seq_len": 64, "checkpoint_every": 0, "analyses": False},
    "dense2moe": {"calib_samples": 1, "seq_len": 128, "steps": 1, "warmup": 0, "checkpoint_every": 0},
    "static_prune": {"calib_samples": 1, "seq_len": 128},
    "teal": {"calib_samples": 1, "seq_len": 128},
}


@pytest.fixture(scope="module")
def texts(shared_assets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    test = (shared_assets / "data" / "wikitext2_raw" / "wiki.test.raw.txt").read_text()
    (folder / "eval.txt").write_text(test[:3000])
    (folder / "prefix.txt").write_text(test[:20000])
    (folder / "calib.txt").write_text((shared_assets / "data" / "wikitext2" / "valid.txt").read_text()[:60000])
    return folder


def test_moeify_eval_prints_what_transformers_own_gguf_load_scores_by_hand(smollm2, texts, tmp_path, capsys):
    import json
    import math

    from moeify.cli.main import main

    folder, _ = smollm2
    assert main(["eval", str(folder / GGUF), "--data", str(texts / "prefix.txt"), "--seq-len", "2048",
                 "--json", str(tmp_path / "eval.json")]) == 0
    got = json.loads((tmp_path / "eval.json").read_text())["ppl"]["prefix.txt"]
    assert f"{got:.3f}" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    ids = [tokenizer.bos_token_id] + tokenizer((texts / "prefix.txt").read_text())["input_ids"]
    nll, scored = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 2048):  # non-overlapping windows, the first token of each unscored
            window = torch.tensor([ids[start:start + 2048]])
            logits = model(window).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum"))
            scored += window.shape[1] - 1
    assert got == pytest.approx(math.exp(nll / scored), rel=1e-5)


@pytest.mark.parametrize("method", list(SMALL))
def test_every_method_converts_the_gguf_and_the_folder_loads_with_moeify_and_transformers(
        method, smollm2, texts, tmp_path):
    import moeify
    from moeify.cli.main import main
    from moeify.methods import METHODS

    assert set(SMALL) == {m.name for m in METHODS}  # a new method must be proven here too
    folder, (_, tokenizer) = smollm2
    sets = [arg for key, value in SMALL[method].items() for arg in ("--set", f"{key}={value}")]
    out = tmp_path / method
    assert main(["convert", str(folder / GGUF), "--method", method, "--out", str(out), "--calib",
                 str(texts / "calib.txt"), "--eval", str(texts / "eval.txt"), "--seq-len", "256", "--no-speed",
                 *sets]) == 0
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        native = moeify.load(out)(ids).logits
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
        assert torch.equal(remote(ids).logits, native)
    assert AutoTokenizer.from_pretrained(out)(PROMPT, return_tensors="pt").input_ids.equal(ids)


def test_dsmoe_training_starts_with_every_gate_on_for_held_out_tokens(smollm2, texts):
    """DSMoE's margin start on a real model, with a batch far below 4 d tokens (1 x 128, d = 576): the fit
    draws 4 d tokens of the training text, and every gate of every layer then starts on (x Y > 0) for
    every token of held-out text too."""
    import copy

    from moeify.calibration.data import read_text, token_stream
    from moeify.methods.base import ConversionContext
    from moeify.methods.dsmoe import DsmoeConfig
    from moeify.methods.dsmoe.convert import partition_model_
    from moeify.methods.dsmoe.train import start_gates_
    from moeify.options import build_config

    _, (model, tokenizer) = smollm2
    ctx = ConversionContext(copy.deepcopy(model), tokenizer, read_text(texts / "calib.txt"), 0, torch.device("cpu"),
                            progress=False)
    cfg = build_config(DsmoeConfig, {"batch_size": 1, "seq_len": 128})
    partition_model_(ctx, cfg)
    layers = [ctx.adapter.mlp_module(i) for i in range(ctx.adapter.num_layers)]
    start = start_gates_(ctx, cfg, layers, token_stream(ctx.calib, tokenizer), 128, resuming=False)
    assert start["gate_start_fit_tokens"] >= 4 * model.config.hidden_size
    logits = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: logits.append(m.router.proj(args[0]).min()))
             for layer in layers]
    ids = tokenizer((texts / "eval.txt").read_text(), return_tensors="pt").input_ids
    with torch.no_grad():
        ctx.model(ids)
    for hook in hooks:
        hook.remove()
    assert len(logits) == len(layers) and min(logits) > 0
