"""Training text from files, folders and lists; large corpora tokenised once into a cached, memory-mapped
token file and streamed."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import moeify
from moeify.calibration import corpus
from moeify.calibration.corpus import FileCorpus, read_corpus
from moeify.calibration.data import EMBEDDED_CALIB, DataError, TextSource, calibration_batches, token_stream
from moeify.files import OutputExistsError, check_not_an_input
from moeify.training.loop import random_windows


@pytest.fixture()
def folder(tmp_path, calib_text):
    """The embedded calibration slice split over a .txt, a .jsonl and a .parquet file."""
    paragraphs = [p for p in calib_text.text.split("\n\n") if p.strip()]
    third = len(paragraphs) // 3
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("\n\n".join(paragraphs[:third]))
    (root / "b.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[third:2 * third]))
    pq.write_table(pa.table({"text": paragraphs[2 * third:], "id": list(range(len(paragraphs) - 2 * third))}),
                   root / "c.parquet")
    (root / "notes.csv").write_text("not read: not a corpus format")
    return root, paragraphs


@pytest.fixture()
def streamed(monkeypatch, tmp_path):
    """Every corpus streamed (no in-memory size), in small pieces, cached under tmp_path."""
    monkeypatch.setattr(corpus, "IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(corpus, "PIECE_CHARS", 4096)
    monkeypatch.setenv("MOEIFY_CACHE", str(tmp_path / "cache"))


def test_a_small_file_is_read_whole_as_before(calib_text, tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(calib_text.text)
    source = read_corpus(path)
    assert isinstance(source, TextSource) and source.text == calib_text.text
    assert read_corpus(EMBEDDED_CALIB) == calib_text
    listed = read_corpus([path, path])
    assert isinstance(listed, TextSource) and listed.text == calib_text.text + "\n\n" + calib_text.text


def test_a_large_corpus_is_tokenised_once_into_a_memory_map(folder, streamed, tokenizer, tmp_path, monkeypatch):
    root, paragraphs = folder
    source = read_corpus(root)
    assert isinstance(source, FileCorpus) and [f.name for f in source.files] == ["a.txt", "b.jsonl", "c.parquet"]
    text = "".join(source.pieces())
    assert text == "\n\n".join(paragraphs)  # the files' texts joined as read_text joins documents
    assert source.sha256 == TextSource("joined", text).sha256
    tokens = token_stream(source, tokenizer)
    cached = list((tmp_path / "cache" / "tokens").glob("*.tokens"))
    assert len(cached) == 1 and cached[0].stat().st_size == 4 * len(tokens)
    assert not list((tmp_path / "cache" / "tokens").glob("*.partial"))
    assert tokens.dtype == torch.int32 and tokens[0] == tokenizer.bos_token_id
    assert abs(len(tokens) - len(token_stream(TextSource("whole", text), tokenizer))) < 0.02 * len(tokens)
    assert tokenizer.decode(tokens[1:200].tolist()).split()[:20] == text.split()[:20]

    monkeypatch.setattr(FileCorpus, "pieces", lambda self: pytest.fail("the text was read again"))
    again = read_corpus(root)
    monkeypatch.setattr(FileCorpus, "sha256", source.sha256)  # the key needs the checksum, not the text
    assert torch.equal(token_stream(again, tokenizer), tokens)
    windows = random_windows(tokens, 32, 4, torch.Generator().manual_seed(0))
    assert windows.dtype == torch.long and windows.shape == (4, 32)
    batches = calibration_batches(again, tokenizer, 3, 16, seed=0)
    assert batches.dtype == torch.long and batches.shape == (3, 16)


def test_training_streams_from_a_folder(folder, streamed, tmp_path):
    root, _ = folder
    result = moeify.convert(None, "dsmoe", {"steps": 2, "checkpoint_every": 0, "analyses": False}, calib=root,
                            measure_speed=False)
    assert result.record["details"]["training"]["steps"] == 2
    assert result.record["data"]["calib"]["name"] == "a.txt+2 more"
    assert len(list((tmp_path / "cache" / "tokens").glob("*.tokens"))) == 1


def test_bad_corpora_are_refused_with_the_file_named(tmp_path, streamed, tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"holds no \.txt.*\.parquet file"):
        read_corpus(empty)
    with pytest.raises(DataError, match=r"table\.csv.*not a format moeify reads"):
        read_corpus(empty / "table.csv")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "wrong.parquet")
    with pytest.raises(DataError, match=r"wrong\.parquet: a \.parquet data file needs a 'text' column"):
        token_stream(read_corpus(tmp_path / "wrong.parquet"), tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2 is not valid JSON"):
        token_stream(read_corpus(tmp_path / "bad.jsonl"), tokenizer)
    (tmp_path / "latin.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    with pytest.raises(DataError, match=r"latin\.txt.*not UTF-8"):
        token_stream(read_corpus(tmp_path / "latin.txt"), tokenizer)
    assert not list((tmp_path / "cache" / "tokens").glob("*"))  # nothing half-written is left



def test_weighted_inputs_are_mixed_in_their_ratio(tmp_path, tokenizer, monkeypatch):
    """``A:1 B:3``: the stream holds A and B tokens 1:3, as long as the scarcer one allows without repeating
    text, the larger one sampled in evenly spaced blocks over its whole length."""
    monkeypatch.setattr(corpus, "MIX_BLOCK", 64)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(f"apple{i % 7}" for i in range(400)))
    b.write_text(" ".join(f"bird {i}" for i in range(3000)))  # no two blocks alike
    mixed = read_corpus([f"{a}:1", f"{b}:3"])
    assert mixed.name == "a.txt:1+b.txt:3" and mixed.sha256 != read_corpus([f"{a}:1", f"{b}:2"]).sha256
    whole_a, whole_b = token_stream(read_corpus(a), tokenizer), token_stream(read_corpus(b), tokenizer)
    tokens = token_stream(mixed, tokenizer)
    assert tokens.dtype == torch.int32 and len(whole_b) > 3 * len(whole_a)  # B is cut down to its share
    assert torch.equal(tokens[:len(whole_a)], whole_a.int())  # the scarce input gives all its tokens
    part_b = tokens[len(whole_a):]
    assert len(part_b) == 3 * len(whole_a)
    blocks = {tuple(whole_b[s:s + 64].tolist()): s for s in range(0, len(whole_b) - 63, 64)}
    taken = [blocks[tuple(part_b[i:i + 64].tolist())] for i in range(0, len(part_b) - 63, 64)]
    assert taken == sorted(taken) and taken[0] == 0  # B's own blocks, in order, from its start ...
    assert taken[-1] >= len(whole_b) * (1 - 1.5 / len(taken))  # ... evenly spread to its end
    windows = calibration_batches(mixed, tokenizer, 8, 16, seed=0)
    assert windows.dtype == torch.long and windows.shape == (8, 16)
    assert read_corpus([f"{a}:1", str(b)]).parts[1][1] == 1.0  # no weight: 1


def test_a_weight_must_be_positive_and_a_file_named_like_a_weight_is_read_as_named(tmp_path, calib_text):
    a = tmp_path / "a.txt"
    a.write_text(calib_text.text)
    with pytest.raises(DataError, match=r"data weight of '.*a\.txt:0' must be > 0"):
        read_corpus([f"{a}:0"])
    with pytest.raises(OutputExistsError, match="which this command reads"):  # the weight does not hide the file
        check_not_an_input(tmp_path, [f"{a}:2"])
    odd = tmp_path / "data:2"  # a folder whose name ends like a weight
    odd.mkdir()
    (odd / "a.txt").write_text(calib_text.text)
    assert read_corpus(odd) == TextSource("a.txt", calib_text.text)
