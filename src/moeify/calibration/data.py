"""Local text and jsonl files -> token streams and calibration batches.

Text is taken as-is and tokenized once, with the tokenizer's BOS only at the very start (the same
protocol the perplexity evaluation uses), so calibration sees the distribution evaluation sees.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

EMBEDDED_CALIB = "embedded:tinystories_calib"
EMBEDDED_EVAL = "embedded:tinystories_eval"
_EMBEDDED = {EMBEDDED_CALIB: "tinystories_calib.txt", EMBEDDED_EVAL: "tinystories_eval.txt"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class TextSource:
    """A named text with its checksum (recorded so that every number says what it was measured on)."""

    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


TEXT_SUFFIXES = (".txt", ".text", ".md", ".raw", ".tokens")  # plain text (WikiText's .raw/.tokens included)
DOC_SEPARATOR = "\n\n"  # between the documents of a .jsonl/.json file, and between files


def read_text(path: str | Path) -> TextSource:
    """Read ``.txt`` as-is; ``.jsonl`` (one object per line) and ``.json`` (a list) by their ``text``
    field, documents joined by a blank line. ``embedded:...`` names the samples shipped in the package."""
    spec = str(path)
    if spec in _EMBEDDED:
        text = resources.files("moeify.data").joinpath(_EMBEDDED[spec]).read_text(encoding="utf-8")
        return TextSource(spec.split(":", 1)[1], text)
    file = Path(spec)
    if file.is_dir():
        raise DataError(f"data file {spec!r} is a folder; name one .txt, .jsonl or .json file in it")
    if not file.is_file():
        raise DataError(f"data file {spec!r} does not exist (expected a .txt, .jsonl or .json file)")
    if file.suffix.lower() not in TEXT_SUFFIXES + (".jsonl", ".json"):
        raise DataError(f"data file {spec!r}: {file.suffix or 'no suffix'} is not a format moeify reads; allowed: "
                        f"{', '.join(TEXT_SUFFIXES)} (text as-is), .jsonl, .json (documents with a 'text' field)")
    try:
        raw = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"data file {spec!r} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    if file.suffix.lower() == ".jsonl":
        text = DOC_SEPARATOR.join(_doc_text(_json_line(line, file, number), file)
                                  for number, line in enumerate(raw.splitlines(), start=1) if line.strip())
    elif file.suffix.lower() == ".json":
        text = DOC_SEPARATOR.join(_doc_text(doc, file) for doc in json_docs(file, raw))
    else:
        text = raw
    if not text.strip():
        raise DataError(f"data file {spec!r} holds no text")
    check_text(text, spec)
    return TextSource(file.name, text)


_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # Unicode's control characters but whitespace


def check_text(text: str, name: str) -> None:
    """Refuse a file that is not text although it decodes (NUL bytes, a binary file renamed .txt): its
    perplexity or calibration would mean nothing. Natural text in any script has control characters other
    than whitespace in well under 1 % of its characters; a fifth or more is not text."""
    control = len(_CONTROL.findall(text))
    if control * 5 >= len(text):
        raise DataError(f"data file {name!r} is not text: {control} of its {len(text)} characters are control "
                        "characters (NUL bytes?)")


def json_docs(file: Path, raw: str) -> list[Any]:
    """The documents of a .json data file (a list), or a ``DataError`` naming the file."""
    try:
        docs = json.loads(raw)
    except json.JSONDecodeError as error:
        raise DataError(f"{file}: not valid JSON (line {error.lineno}: {error.msg})") from None
    if not isinstance(docs, list):
        raise DataError(f"{file}: a .json data file must hold a list of strings or of objects with 'text'")
    return docs


def _json_line(line: str, file: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{file}: line {number} is not valid JSON ({error.msg})") from None


def _doc_text(doc: Any, file: Path) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return doc["text"]
    raise DataError(f"{file}: every record needs a string 'text' field, got {str(doc)[:80]!r}")


def bos_first(ids: list[int], tokenizer: Any) -> list[int]:
    """``ids`` starting with the tokenizer's BOS if it has one (added here when the tokenizer does not add
    it itself, as the tokenizers read from GGUF files do not)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos, *ids] if bos is not None and ids[:1] != [bos] else ids


def token_stream(source: Any, tokenizer: Any) -> Tensor:
    """The whole text tokenized once: (n_tokens,), the tokenizer's BOS at the start if it has one. A
    ``corpus.FileCorpus`` gives its memory-mapped token file instead (int32; windows are cast on use)."""
    if not isinstance(source, TextSource):
        return source.tokens(tokenizer)
    ids = bos_first(tokenizer(source.text, return_attention_mask=False, verbose=False)["input_ids"], tokenizer)
    if len(ids) < 2:
        raise DataError(f"{source.name}: the text gives only {len(ids)} token(s)")
    return torch.tensor(ids, dtype=torch.long)


def check_enough_text(source: TextSource, windows: int, seq_len: int) -> None:
    """Refuse, before any model work, a text too short for ``windows`` disjoint windows of ``seq_len`` tokens
    whatever the tokenizer: a token spans at least one UTF-8 byte (byte-level BPE, SentencePiece with byte
    fallback), plus the BOS. The exact count (``calibration_batches``) follows once the text is tokenized."""
    most = len(source.text.encode()) + 1
    if most < windows * seq_len:
        raise DataError(f"{source.name}: {most} tokens at most, fewer than the {windows} windows of seq_len={seq_len} "
                        f"({windows * seq_len} tokens) the method draws; pass more text or lower calib_samples or "
                        "seq_len")


def calibration_batches(source: TextSource, tokenizer: Any, num_samples: int, seq_len: int, seed: int) -> Tensor:
    """``num_samples`` disjoint windows of ``seq_len`` tokens at random places of the stream:
    (num_samples, seq_len)."""
    stream = token_stream(source, tokenizer)
    slots = len(stream) // seq_len
    if slots < num_samples:
        raise DataError(f"{source.name}: {len(stream)} tokens give {slots} windows of seq_len={seq_len}, "
                        f"fewer than calib_samples={num_samples}; pass more text or lower either value")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=generator)[:num_samples].sort().values
    return torch.stack([stream[s * seq_len:(s + 1) * seq_len] for s in chosen.tolist()]).long()
