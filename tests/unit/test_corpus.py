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

