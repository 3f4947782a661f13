"""Training text larger than memory: files tokenised once into a memory-mapped token file, then streamed.

``read_corpus`` takes a file, a folder, or a list of them (.txt and the other plain-text suffixes,
.jsonl, .json, .parquet with a ``text`` column). A corpus small enough to hold (``IN_MEMORY_BYTES``)
is read as one ``TextSource`` and tokenised whole, as every text always was. A larger one becomes a
``FileCorpus``: its text is read one piece at a time (a document, or up to ``PIECE_CHARS`` of a plain
text file cut at a paragraph break), each piece tokenised and appended to a token file in the cache
(``$MOEIFY_CACHE``, else ``~/.cache/moeify``), named by the SHA-256 of the text and of the tokenizer,
so the same corpus is tokenised once whatever runs it. Training and calibration windows are then read
from that file through a memory map: a run over a billion tokens holds the windows it uses, not its text.
Pieces are tokenised apart (no BOS after the first), so tokens at a piece's edge may differ from a
whole-text tokenisation; the text itself is the same.

Inputs given with weights (``A.txt:1 B.jsonl:1``) form a ``MixedCorpus``: a token stream in which each
input holds its weight's share, so windows drawn anywhere in it come from the inputs in that ratio.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from moeify.calibration.data import (
    DOC_SEPARATOR,
    TEXT_SUFFIXES,
    DataError,
    TextSource,
    _doc_text,
    _json_line,
    bos_first,
    json_docs,
    read_text,
    token_stream,
)
from moeify.files import split_weight

IN_MEMORY_BYTES = 64 * 2**20  # corpora up to this size are read whole (TextSource)
PIECE_CHARS = 2**20           # how much plain text is tokenised at once
CORPUS_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".json", ".parquet")
TOKEN_DTYPE = np.int32
TOKENS_FORMAT = 1             # bump when the tokenisation of pieces changes
MIX_BLOCK = 16384             # tokens a mixed input contributes at a time (several windows of any seq_len)


def corpus_files(paths: str | Path | list[str | Path]) -> list[Path]:
    """The files behind ``paths``: files as given, folders by their readable files (sorted)."""
    files: list[Path] = []
    for spec in paths if isinstance(paths, list) else [paths]:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES)
            if not found:
                raise DataError(f"data folder {str(path)!r} holds no {', '.join(CORPUS_SUFFIXES)} file")
            files += found
        elif not path.is_file():
            raise DataError(f"data file {str(spec)!r} does not exist (expected a file or a folder of "
                            f"{', '.join(CORPUS_SUFFIXES)} files)")
        elif path.suffix.lower() not in CORPUS_SUFFIXES:
            raise DataError(f"data file {str(spec)!r}: {path.suffix or 'no suffix'} is not a format moeify reads; "
                            f"allowed: {', '.join(CORPUS_SUFFIXES)}")
        else:
            files.append(path)
    return files


def read_corpus(paths: str | Path | list[str | Path]) -> Corpus:
    """Calibration/training text from a file, a folder or a list: whole in memory when small (an
    ``embedded:`` name included), else streamed from the files (see the module docstring); inputs with a
    ``:weight`` suffix are mixed in that ratio (an input without one weighs 1)."""
    specs = paths if isinstance(paths, list) else [paths]
    weighted = [split_weight(spec) for spec in specs]
    if any(weight is not None for _, weight in weighted):
        for spec, (_, weight) in zip(specs, weighted):
            if weight is not None and weight <= 0:
                raise DataError(f"data weight of {str(spec)!r} must be > 0")
        return MixedCorpus(tuple((read_corpus(path), 1.0 if weight is None else weight) for path, weight in weighted))
    if not isinstance(paths, list) and str(paths).startswith("embedded:"):
        return read_text(paths)
    files = corpus_files(paths)
    if sum(f.stat().st_size for f in files) > IN_MEMORY_BYTES or any(f.suffix.lower() == ".parquet" for f in files):
        return FileCorpus(files)
    if len(files) == 1:
        return read_text(files[0])
    sources = [read_text(f) for f in files]
    return TextSource("+".join(s.name for s in sources), DOC_SEPARATOR.join(s.text for s in sources))


@dataclass(frozen=True)
class FileCorpus:
    """Text files read piece by piece; the text is the files' texts joined by a blank line (a .jsonl,
    .json or .parquet file's text: its documents joined the same way), as ``read_text`` joins them."""

    files: list[Path]

    @property
    def name(self) -> str:
        return self.files[0].name if len(self.files) == 1 else f"{self.files[0].name}+{len(self.files) - 1} more"

    def pieces(self) -> Iterator[str]:
        """The text in order, in pieces whose concatenation is the text."""
        for n, file in enumerate(self.files):
            if n:
                yield DOC_SEPARATOR
            yield from _file_pieces(file)

    @cached_property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for piece in self.pieces():
            digest.update(piece.encode())
        return digest.hexdigest()

    def tokens(self, tokenizer: Any) -> Tensor:
        """The corpus as token ids, memory-mapped from the cache (tokenised on first use): (n_tokens,)."""
        path = cache_dir() / f"{self._key(tokenizer)}.tokens"
        if not path.is_file():
            self._write_tokens(tokenizer, path)
        return torch.from_numpy(np.memmap(path, dtype=TOKEN_DTYPE, mode="c"))

    def _key(self, tokenizer: Any) -> str:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
        return hashlib.sha256(f"{TOKENS_FORMAT}\n{self.sha256}\n{vocab}".encode()).hexdigest()[:32]

    def _write_tokens(self, tokenizer: Any, path: Path) -> None:
        """Tokenise piece by piece into ``path`` (written beside it, then renamed: never half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        count = 0
        try:
            with open(partial, "wb") as out:
                for n, piece in enumerate(p for p in self.pieces() if p.strip()):
                    ids = tokenizer(piece, add_special_tokens=not n, return_attention_mask=False,
                                    verbose=False)["input_ids"]
                    ids = bos_first(ids, tokenizer) if not n else ids
                    out.write(np.asarray(ids, dtype=TOKEN_DTYPE).tobytes())
                    count += len(ids)
            if count < 2:
                raise DataError(f"{self.name}: the text gives only {count} token(s)")
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


@dataclass(frozen=True)
class MixedCorpus:
    """Texts mixed by weight: the token stream holds each part's weight's share of its tokens.

    The stream is as long as the scarcest part allows (the one with the fewest tokens per unit of weight
    gives all of them), so no text is repeated; every other part gives its share as evenly spaced blocks of
    ``MIX_BLOCK`` tokens, sampled over its whole length rather than its start. Parts follow one another in
    the order given, so a window may straddle two of them at a border, as it may straddle two documents."""

    parts: tuple[tuple[TextSource | FileCorpus, float], ...]

    @property
    def name(self) -> str:
        return "+".join(f"{source.name}:{weight:g}" for source, weight in self.parts)

    @cached_property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for source, weight in self.parts:
            digest.update(f"{source.sha256}:{weight!r}\n".encode())
        return digest.hexdigest()

    def tokens(self, tokenizer: Any) -> Tensor:
        """The mixed stream (int32, as a ``FileCorpus`` gives): (n_tokens,)."""
        streams = [token_stream(source, tokenizer) for source, _ in self.parts]
        total = sum(weight for _, weight in self.parts)
        shares = [weight / total for _, weight in self.parts]
        length = min(len(stream) / share for stream, share in zip(streams, shares))
        return torch.cat([_spread_blocks(stream, round(length * share)).to(torch.int32)
                          for stream, share in zip(streams, shares)])


def _spread_blocks(stream: Tensor, count: int) -> Tensor:
    """``count`` tokens of ``stream`` as blocks of ``MIX_BLOCK`` spread evenly over it (the whole stream when
    it has no more)."""
    if count >= len(stream):
        return stream
    blocks, rest = divmod(count, MIX_BLOCK)
    available = len(stream) // MIX_BLOCK
    if blocks == 0 or available == 0:
        return stream[:count]
    starts = [j * available // blocks * MIX_BLOCK for j in range(blocks)]
    pieces = [stream[s:s + MIX_BLOCK] for s in starts]
    if rest:
        after = starts[-1] + MIX_BLOCK
        pieces.append(stream[after:after + rest] if after + rest <= len(stream) else stream[-rest:])
    return torch.cat(pieces)


Corpus = TextSource | FileCorpus | MixedCorpus  # what calibration and training read


def cache_dir() -> Path:
    return Path(os.environ.get("MOEIFY_CACHE") or Path.home() / ".cache" / "moeify") / "tokens"


def _file_pieces(file: Path) -> Iterator[str]:
    """One file's text in pieces: a document at a time (.jsonl, .json, .parquet, joined by blank lines)
    or up to ``PIECE_CHARS`` of plain text, cut after a paragraph break where there is one."""
    suffix = file.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield from _text_pieces(file)
        return
    if suffix == ".json":
        docs: Iterator[Any] = iter(json_docs(file, file.read_text(encoding="utf-8")))
    elif suffix == ".jsonl":
        docs = _jsonl_docs(file)
    else:
        docs = _parquet_docs(file)
    for n, doc in enumerate(docs):
        if n:
            yield DOC_SEPARATOR
        yield _doc_text(doc, file)


def _text_pieces(file: Path) -> Iterator[str]:
    carry = ""
    with open(file, encoding="utf-8") as handle:
        try:
            while chunk := handle.read(PIECE_CHARS):
                text = carry + chunk
                cut = text.rfind(DOC_SEPARATOR)
                cut = len(text) if cut <= 0 else cut + len(DOC_SEPARATOR)
                piece, carry = text[:cut], text[cut:]
                yield piece
        except UnicodeDecodeError as error:
            raise DataError(f"data file {str(file)!r} is not UTF-8 text ({error.reason})") from None
    if carry:
        yield carry


def _jsonl_docs(file: Path) -> Iterator[Any]:
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield _json_line(line, file, number)


def _parquet_docs(file: Path) -> Iterator[str]:
    import pyarrow.parquet as pq  # here: ``import moeify`` stays light

    parquet = pq.ParquetFile(file)
    if "text" not in parquet.schema_arrow.names:
        raise DataError(f"{file}: a .parquet data file needs a 'text' column; it has {parquet.schema_arrow.names}")
    for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
        yield from batch.column(0).to_pylist()
