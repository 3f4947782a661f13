"""Perplexity protocol, activated-parameter accounting checked by hand, calibration data handling."""

import json
import math

import pytest
import torch

from moeify.calibration.data import DataError, TextSource, calibration_batches, read_text, token_stream
from moeify.evaluation.perplexity import Perplexity, perplexity, relative_change
from moeify.methods.cmoe import CmoeConfig
from moeify.methods.cmoe.convert import convert
from moeify.moe.accounting import activated_parameters, tracking_routing
from moeify.options import build_config
from tests.helpers.conversion import clone
from tests.helpers.tiny_models import STORIES_VOCAB, tiny_model


def _direct_nll(model, ids: list[int], seq_len: int, stride: int) -> tuple[float, int]:
    """Hugging Face's own loss over windows of seq_len advancing by stride, each token scored once."""
    total, count, scored_until = 0.0, 0, 1
    with torch.no_grad():
        for start in range(0, len(ids) - 1, stride):
            window = torch.tensor(ids[start:start + seq_len])[None]
            if window.shape[1] < 2 or start + window.shape[1] <= scored_until:
                continue
            labels = window.clone()
            labels[:, :max(1, scored_until - start)] = -100  # already scored (or the first token)
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=window, labels=labels).loss) * n
            count += n
            scored_until = start + window.shape[1]
    return total / count, count


def test_moeify_eval_matches_direct_transformers_computation(stories, eval_text, tmp_path):
    """The pinned protocol: text as-is, tokenized once, BOS only at the start, non-overlapping 512-token
    windows, first token of each window unscored; within 0.005 nats of transformers' own loss."""
    from moeify.cli.main import main

    model, tokenizer = stories
    path = tmp_path / "eval.txt"
    path.write_text(eval_text.text)
    assert main(["eval", "embedded:stories260K", "--data", str(path), "--seq-len", "512",
                 "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())["eval"]["eval.txt"]
    ids = tokenizer(eval_text.text, verbose=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    nll, count = _direct_nll(model, ids, 512, 512)
    assert result["tokens"] == count and result["protocol"] == "windows"
    assert abs(result["nll"] - nll) < 0.005
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]))
    assert result["sha256"] == eval_text.sha256
    assert 3.0 < result["ppl"] < 5.0  # stories260K's reported TinyStories loss is about 1.3 nats


def test_sliding_and_bos_per_doc_protocols(stories, eval_text):
    model, tokenizer = stories
    short = TextSource("short", eval_text.text[:6000])
    ids = tokenizer(short.text, verbose=False)["input_ids"]
    sliding = perplexity(model, tokenizer, short, seq_len=256, protocol="sliding", stride=128)
    nll, count = _direct_nll(model, ids, 256, 128)
    assert sliding.tokens == count == len(ids) - 1 and abs(sliding.nll - nll) < 1e-4
    assert sliding.nll < perplexity(model, tokenizer, short, seq_len=256).nll  # more context per token
    per_doc = perplexity(model, tokenizer, short, seq_len=256, protocol="bos-per-doc")
    docs = [d for d in short.text.split("\n\n") if d.strip()]
    assert per_doc.tokens == sum(len(tokenizer(d, verbose=False)["input_ids"]) for d in docs) - per_doc.windows
    with pytest.raises(ValueError, match="stride is required by, and only by"):
        perplexity(model, tokenizer, short, seq_len=256, protocol="sliding")


def _scored(nlls: list[float], tokens: list[int]) -> Perplexity:
    mean = sum(nlls) / sum(tokens)
    return Perplexity(math.exp(mean), mean, sum(tokens), len(tokens), 64, "sha", "windows",
                      window_nll=tuple(nlls), window_tokens=tuple(tokens))


def test_relative_change_is_paired_over_windows(stories, eval_text):
    """Per-window sums add up to the perplexity; a model against itself changes by 0 +- 0; a constant
    per-token shift has no sampling error; the error of uneven shifts is the spread of the window means."""
    model, tokenizer = stories
    short = TextSource("short", eval_text.text[:6000])
    result = perplexity(model, tokenizer, short, seq_len=128)
    assert len(result.window_nll) == result.windows == len(result.window_tokens)
    assert sum(result.window_tokens) == result.tokens
    assert math.fsum(result.window_nll) / result.tokens == pytest.approx(result.nll, rel=1e-12)
    assert "window_nll" not in result.as_dict()
    assert relative_change(result, result) == (0.0, 0.0)

    base = _scored([10.0, 20.0, 30.0, 40.0], [10, 10, 10, 10])
    shifted = _scored([11.0, 21.0, 31.0, 41.0], [10, 10, 10, 10])  # +0.1 nats on every token
    change, error = relative_change(base, shifted)
    assert change == pytest.approx(math.exp(0.1) - 1) and error == pytest.approx(0.0, abs=1e-12)
    uneven = _scored([12.0, 20.0, 32.0, 40.0], [10, 10, 10, 10])  # window means +0.2, 0, +0.2, 0
    change, error = relative_change(base, uneven)
    # D = 0.1; residuals per window (d_w - D t_w) = +-1; sqrt(4 * 4 / 3) / 40 nats, times exp(D)
    assert change == pytest.approx(math.exp(0.1) - 1)
    assert error == pytest.approx(math.exp(0.1) * math.sqrt(16 / 3) / 40)
    with pytest.raises(ValueError, match="same text in the same windows"):
        relative_change(base, _scored([1.0, 2.0], [10, 30]))
    change, error = relative_change(_scored([10.0], [10]), _scored([12.0], [10]))
    assert change == pytest.approx(math.exp(0.2) - 1) and error is None  # one window: no spread


def test_activated_parameters_by_hand(make_ctx):
    model = tiny_model("llama", **STORIES_VOCAB)
    ctx = make_ctx(model)
    convert(ctx, build_config(CmoeConfig, {"spec": "S1A2E8", "calib_samples": 4, "seq_len": 64}))
    d, d_h, layers = 64, 88, 2
    attn = layers * (d * d + d * 32 + d * 32 + d * d)  # q, k, v (2 kv heads x 16), o; no biases
    mlp = layers * 3 * d * d_h
    nominal = activated_parameters(ctx.model, measured=False)
    active_mlp = layers * 3 * d * (11 + 2 * 11)  # shared 11 neurons + 2 routed experts of 11
    assert nominal.total_params == attn + mlp
    assert nominal.active_params == pytest.approx(attn + active_mlp)
    assert nominal.mlp_ratio == pytest.approx(3 / 8)
    assert nominal.apr == pytest.approx((attn + active_mlp) / (attn + mlp))
    assert nominal.router_params == layers * (2 * d * 7 + 7)  # representative gate/up rows + u
    with tracking_routing(ctx.model) as moe_layers:
        ctx.model(torch.randint(0, 512, (2, 30)))
    measured = activated_parameters(ctx.model, measured=True)
    assert all(layer.stats_tokens == 60 for layer in moe_layers)
    assert measured.measured and measured.mlp_ratio == pytest.approx(3 / 8)  # equal experts: exact


def test_calibration_batches_are_disjoint_windows(tokenizer, calib_text):
    batches = calibration_batches(calib_text, tokenizer, num_samples=4, seq_len=128, seed=0)
    stream = token_stream(calib_text, tokenizer)
    assert batches.shape == (4, 128)
    starts = [next(i for i in range(0, len(stream), 128) if torch.equal(stream[i:i + 128], b)) for b in batches]
    assert len(set(starts)) == 4
    assert torch.equal(batches, calibration_batches(calib_text, tokenizer, 4, 128, seed=0))


def test_data_errors_are_clear(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="holds no text"):
        read_text(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="fewer than calib_samples=100"):
        calibration_batches(TextSource("short", "Once upon a time " * 50), tokenizer, 100, 64, 0)
    (tmp_path / "docs.jsonl").write_text('{"text": "a b"}\n{"text": "c"}\n')
    assert read_text(tmp_path / "docs.jsonl").text == "a b\n\nc"
    (tmp_path / "bad.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(DataError, match="string 'text' field"):
        read_text(tmp_path / "bad.jsonl")


def test_streaming_reproduces_the_models_hidden_states(stories, tokenizer, calib_text):
    from moeify.arch import DecoderAdapter
    from moeify.calibration.stream import stream_layers

    model = clone(stories[0])
    batches = calibration_batches(calib_text, tokenizer, 2, 64, 0)
    with torch.no_grad():
        hidden = model(input_ids=batches, output_hidden_states=True).hidden_states
    adapter = DecoderAdapter(model)
    for step in stream_layers(model, adapter, batches, device="cpu", batch_size=1):
        got = torch.cat(step.inputs.hidden)
        torch.testing.assert_close(got, hidden[step.index], atol=1e-5, rtol=1e-5)


def test_data_files_are_read_by_format_and_bad_ones_named_with_their_line(tmp_path):
    from moeify.calibration.data import DataError, read_text

    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match=r"\.csv is not a format moeify reads; allowed: \.txt"):
        read_text(tmp_path / "table.csv")
    (tmp_path / "data.parquet").write_bytes(b"PAR1\x00\xff")
    with pytest.raises(DataError, match=r"\.parquet is not a format"):
        read_text(tmp_path / "data.parquet")
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"docs.jsonl: line 4 is not valid JSON"):
        read_text(tmp_path / "docs.jsonl")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8 text"):
        read_text(tmp_path / "latin.txt")
    (tmp_path / "ok.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert read_text(tmp_path / "ok.jsonl").text == "one\n\ntwo"
