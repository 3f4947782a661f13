"""Runtime options of a converted model (router options such as ``top_k``) hold for what asked for them:
``set_runtime_options`` returns the function that puts the previous values back, and ``evaluate`` uses it."""

from __future__ import annotations

import moeify
from moeify.methods import get_method
from moeify.moe.accounting import moe_layers
from moeify.options import build_config
from tests.helpers.conversion import conversion_context
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model


def converted(tokenizer, calib_text):
    method = get_method("random_split")
    ctx = conversion_context(tiny_model("llama", intermediate_size=128, **STORIES_VOCAB), tokenizer, calib_text)
    method.run(ctx, build_config(method.config_cls, {"spec": "S1A1E8", "calib_samples": 2, "seq_len": 64}))
    return ctx.model.eval()


def top_ks(model) -> list[int]:
    return [layer.router.top_k for layer in moe_layers(model)]


def test_set_runtime_options_returns_its_undo(tokenizer, calib_text):
    model = converted(tokenizer, calib_text)
    restore = moeify.set_runtime_options(model, {"top_k": 5})
    assert top_ks(model) == [5] * len(top_ks(model))
    restore()
    assert top_ks(model) == [1] * len(top_ks(model))


def test_evaluate_gives_the_model_its_own_options_back(tokenizer, calib_text, eval_text):
    model = converted(tokenizer, calib_text)
    results = moeify.evaluate(model, tokenizer, runtime_options={"top_k": 7}, seq_len=64)
    assert results["active"]["mlp_ratio"] == 1.0  # every expert ran during the evaluation
    assert top_ks(model) == [1] * len(top_ks(model))
