"""Write a standard-format export (``hf_export.HfExport``) as one GGUF file that llama.cpp runs.

The file holds what llama.cpp's own converter writes for the same checkpoint (architecture, hyperparameters,
tokenizer, tensors under its names and types) plus moeify's export record under ``moeify.export`` (JSON),
which llama.cpp ignores. f32, f16 and q8_0 are written here with the ``gguf`` package's encoders; k-quants
(q4_k_m) need llama.cpp's quantiser, run on the f16 file (``quantize``).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import gguf

from moeify.export.gguf.metadata import ARCHITECTURES, NEEDS_OUTPUT, ROTATES_HALVES, add_hyperparameters
from moeify.export.gguf.qwen2moe import all_routed
from moeify.export.gguf.quantize import LLAMA_QUANTS, llama_quantize
from moeify.export.gguf.tensors import FILE_TYPES, encoded, gguf_tensors, tensor_type
from moeify.export.gguf.vocab import Vocabulary
from moeify.export.hf_export import HfExport
from moeify.files import atomic_file

RECORD_KEY = "moeify.export"
QUANTS = (*FILE_TYPES, *LLAMA_QUANTS)


def write_gguf(export: HfExport, path: Path, vocabulary: Vocabulary, quant: str = "f16",
               record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``export`` to ``path`` (atomically) in ``quant``; return what was written (architecture, file
    type, tensors per type, size)."""
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r} is not one of {', '.join(QUANTS)}")
    path = Path(path)
    with atomic_file(path) as tmp:
        if quant in LLAMA_QUANTS:
            f16 = Path(tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)[1])  # stale ones swept too
            try:
                _write(export, f16, vocabulary, "f16", record)
                llama_quantize(f16, tmp, quant)
            finally:
                f16.unlink(missing_ok=True)
        else:
            _write(export, tmp, vocabulary, quant, record)
        summary = describe(tmp)
    return summary


def _write(export: HfExport, path: Path, vocabulary: Vocabulary, quant: str, record: dict[str, Any] | None) -> None:
    config = export.model.config
    file_type, quantised = FILE_TYPES[quant]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCHITECTURES[export.format]])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(str(getattr(config, "_name_or_path", "") or f"moeify {export.format} export"))
    add_hyperparameters(writer, export.format, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocabulary.add_to(writer)
    writer.add_string(RECORD_KEY, json.dumps({**export.record, **(record or {})}, default=str))
    state = export.model.state_dict()
    if export.format == "qwen2_moe":
        state = all_routed(state, config)
    for name, value in gguf_tensors(state, config, interleave=export.format not in ROTATES_HALVES,
                                    tied_output=export.format in NEEDS_OUTPUT):
        qtype = tensor_type(name, value, quantised)
        writer.add_tensor(name, encoded(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def describe(path: Path) -> dict[str, Any]:
    """What a GGUF file holds: architecture, file type, how many tensors of each type, its size in bytes."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    file_type = gguf.LlamaFileType(reader.fields["general.file_type"].contents())
    return {"architecture": arch, "file_type": file_type.name,
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
            "tensors": len(reader.tensors), "bytes": Path(path).stat().st_size}
