"""A GGUF file moeify cannot use gets one line naming it, not a traceback: a corrupt file, and a valid
GGUF of an architecture moeify does not convert."""

import numpy as np
import pytest

from moeify.arch import supported_model_types
from moeify.cli.main import main


@pytest.fixture()
def mamba_gguf(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_corrupt_gguf_is_one_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    assert main(["eval", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"moeify eval: error: {bad}: not a GGUF model transformers can read")


def test_a_gguf_of_another_family_is_refused_before_any_work(mamba_gguf, tmp_path, capsys):
    assert main(["convert", str(mamba_gguf), "--method", "cmoe", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    supported = ", ".join(supported_model_types())
    assert err == f"moeify convert: error: unsupported model_type 'mamba'; moeify supports: {supported}"
    assert not (tmp_path / "out").exists()
