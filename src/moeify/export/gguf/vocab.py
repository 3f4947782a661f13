"""The tokenizer section of a GGUF file, taken from where the dense model came from.

llama.cpp tokenizes from the GGUF's own ``tokenizer.ggml.*`` keys, so they must be the dense model's
exactly. A model that came from a GGUF file has them already: they are copied key by key. A Hugging Face
folder with a SentencePiece ``tokenizer.model`` (LLaMA-2, Mistral, TinyLlama) gets them as llama.cpp's
converter writes them: every piece with its score and type, the special token ids. A byte-level BPE
tokenizer (``tokenizer.json`` only) is not written: llama.cpp needs the name of its pre-tokenizer, which
its converter recognises by hashing the tokenization of a probe text against a table of known models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from moeify.sources import model_source


class NoGgufVocabulary(ValueError):
    """The dense model's tokenizer cannot be written into a GGUF file by moeify."""


@dataclass(frozen=True)
class Vocabulary:
    """Key-value pairs of the tokenizer section: (key, value, value type, element type of an array)."""

    entries: list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = field(default_factory=list)
    source: str = ""
    special: gguf.SpecialVocab | None = None  # special token ids and chat template of a Hugging Face folder

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        for key, value, vtype, sub_type in self.entries:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
        if self.special is not None:
            self.special.add_to_gguf(writer, quiet=True)


def from_gguf(path: Path) -> Vocabulary:
    """The ``tokenizer.*`` keys of a GGUF file, as they are."""
    reader = gguf.GGUFReader(path)
    entries = []
    for key, entry in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = entry.types[0]
        sub_type = entry.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = entry.contents()
        if sub_type == gguf.GGUFValueType.STRING:
            value = [item.encode("utf-8") if isinstance(item, str) else item for item in value]
        entries.append((key, value, vtype, sub_type))
    return Vocabulary(entries, source=str(path))


def from_sentencepiece(folder: Path, vocab_size: int) -> Vocabulary:
    """llama.cpp's ``llama`` tokenizer from ``folder/tokenizer.model``: pieces, scores and types in id
    order, padded to ``vocab_size`` with unused pieces, and the special ids of the folder's configs."""
    from sentencepiece import SentencePieceProcessor

    processor = SentencePieceProcessor()
    processor.LoadFromFile(str(folder / "tokenizer.model"))
    _check_added_tokens(folder, processor)
    types = gguf.TokenType
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, kinds = [-10000.0] * vocab_size, [int(types.UNUSED)] * vocab_size
    for i in range(min(vocab_size, processor.vocab_size())):
        tokens[i], scores[i] = processor.IdToPiece(i).encode("utf-8"), processor.GetScore(i)
        kinds[i] = int(types.UNKNOWN if processor.IsUnknown(i) else types.CONTROL if processor.IsControl(i)
                       else types.UNUSED if processor.IsUnused(i) else types.BYTE if processor.IsByte(i)
                       else types.NORMAL)
    value = gguf.GGUFValueType
    entries: list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = [
        (gguf.Keys.Tokenizer.MODEL, "llama", value.STRING, None),
        (gguf.Keys.Tokenizer.PRE, "default", value.STRING, None),
        (gguf.Keys.Tokenizer.LIST, tokens, value.ARRAY, value.STRING),
        (gguf.Keys.Tokenizer.SCORES, scores, value.ARRAY, value.FLOAT32),
        (gguf.Keys.Tokenizer.TOKEN_TYPE, kinds, value.ARRAY, value.INT32)]
    return Vocabulary(entries, source=str(folder / "tokenizer.model"),
                      special=gguf.SpecialVocab(folder, load_merges=False, n_vocab=vocab_size))


def _check_added_tokens(folder: Path, processor: Any) -> None:
    """Refuse tokens the folder adds beyond the SentencePiece model (llama.cpp's converter rewrites their
    types by rules this writer does not reproduce)."""
    config = folder / "tokenizer_config.json"
    added = json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
    added_file = folder / "added_tokens.json"
    extra = json.loads(added_file.read_text()) if added_file.is_file() else {}
    pieces = {int(i): data["content"] for i, data in added.items()} | {int(i): t for t, i in extra.items()}
    for token_id, text in sorted(pieces.items()):
        if token_id >= processor.vocab_size() or processor.IdToPiece(token_id) != text:
            raise NoGgufVocabulary(f"the tokenizer in {folder} adds token {text!r} (id {token_id}) beyond its "
                                   "SentencePiece model; export --format llama/granitemoeshared and convert that "
                                   "folder with llama.cpp's convert_hf_to_gguf.py")


def vocabulary(candidates: list[str | Path], vocab_size: int) -> Vocabulary:
    """The tokenizer section for a model whose tokenizer is found in the first of ``candidates`` that holds
    one (the converted folder, then the dense model it came from: a GGUF file or a local folder)."""
    for candidate in candidates:
        source = model_source(str(candidate))
        path = Path(source.path)
        if source.gguf_file is not None and (path / source.gguf_file).is_file():
            return from_gguf(path / source.gguf_file)
        if path.is_dir() and (path / "tokenizer.model").is_file():
            return from_sentencepiece(path, vocab_size)
    raise NoGgufVocabulary(
        f"no GGUF file or SentencePiece tokenizer.model in {', '.join(map(str, candidates))}: moeify writes a "
        "GGUF tokenizer from one of those; for a byte-level BPE tokenizer export --format granitemoeshared "
        "(or llama) and convert that folder with llama.cpp's convert_hf_to_gguf.py")
