"""The token comparison behind the serving checks (vLLM itself: tests/integration/test_serve_vllm.py)."""

import torch

from moeify.evaluation.serving import (
    compare_tokens,
    forced_agreement,
    forced_logits,
    margins_at,
    native_tokens,
    root_cause,
)
from tests.helpers.tiny_models import tiny_model


def test_compare_tokens_says_where_sequences_part():
    result = compare_tokens([[1, 2, 3], [1, 2, 3], [1, 2]], [[1, 2, 3], [1, 5, 3], [1, 2, 3]])
    assert result["identical_sequences"] == 1 and result["first_difference"] == [None, 1, 2]
    assert result["token_agreement"] == 7 / 8


def test_native_greedy_decoding_with_the_cache_is_the_argmax_of_the_full_forward():
    model = tiny_model("llama").eval()
    prompts = [[5, 9, 11], [7, 3]]
    tokens = native_tokens(model, prompts, 6)
    with torch.no_grad():
        for prompt, continuation in zip(prompts, tokens):
            logits = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:-1]
            assert logits.argmax(dim=-1).tolist() == continuation
    margins = margins_at(model, prompts, tokens, [None, 2])
    assert margins[0] is None and margins[1] >= 0


def test_teacher_forced_agreement_counts_broken_ties_and_measures_logit_gaps():
    model = tiny_model("llama").eval()
    prompts = [[5, 9, 11], [7, 3]]
    tokens = native_tokens(model, prompts, 6)
    native = [forced_logits(model, p, t) for p, t in zip(prompts, tokens)]
    assert [n.argmax(dim=-1).tolist() for n in native] == tokens
    same = forced_agreement(tokens, native, [n.clone() for n in native])
    assert same == {"forced_positions": 12, "max_abs_logit_diff": 0.0, "max_abs_logit_diff_at": [0, 0],
                    "median_position_logit_diff": 0.0, "argmax_differences": 0,
                    "largest_native_margin_at_a_difference": None}
    engine = [n.clone() for n in native]
    engine[1][4, tokens[1][4]] -= 100.0  # one position's native token demoted: a broken choice
    result = forced_agreement(tokens, native, engine)
    top = native[1][4].topk(2).values
    assert result["argmax_differences"] == 1 and result["max_abs_logit_diff"] == 100.0
    assert result["max_abs_logit_diff_at"] == [1, 4] and result["median_position_logit_diff"] == 0.0
    assert result["largest_native_margin_at_a_difference"] == float(top[0] - top[1])


def test_a_failed_engine_is_reported_by_its_root_cause_not_the_clients_generic_error():
    output = ("INFO starting\n[rank0]: Traceback (most recent call last):\n"
              "[rank0]: RuntimeError: zentorch_fused_moe: only 1 expert(s) received tokens.\n"
              "Traceback (most recent call last):\n"
              "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert root_cause(output) == "RuntimeError: zentorch_fused_moe: only 1 expert(s) received tokens."
    assert root_cause(output.split("[rank0]: RuntimeError")[0] + "ValueError: bad\n") == "ValueError: bad"
    logged = ("(MainProcess pid=1) WARNING 11-24 [base.py:380] ValueError: not the cause\n"
              "(Worker pid=2) ERROR 11-24 01:12:20 [multiproc_executor.py:1063] RuntimeError: only 1 expert\n"
              "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert root_cause(logged) == "RuntimeError: only 1 expert"
    assert root_cause("no exception here\nkilled") == "killed"
