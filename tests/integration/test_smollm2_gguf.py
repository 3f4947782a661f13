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
