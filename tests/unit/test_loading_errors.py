"""Model inputs a user gets wrong: one line naming the path and the problem, exit code 2, no traceback."""

import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from moeify.cli.main import main
from moeify.sources import EMBEDDED_MODEL, model_source

STORIES = model_source(EMBEDDED_MODEL).path


def broken(tmp_path, name, *, config=True, weights=True, tokenizer=True):
    folder = tmp_path / name
    folder.mkdir()
    for file in sorted(p.name for p in Path(STORIES).iterdir()):
        wanted = (config and file == "config.json") or (weights and file == "model.safetensors") or \
            (tokenizer and ("token" in file or file == "special_tokens_map.json"))
        if wanted:
            shutil.copy(f"{STORIES}/{file}", folder / file)
    return folder


@pytest.mark.parametrize("case,message", [
    ("missing", "no such model folder or file"),
    ("not_a_model", "is not a model folder: it has no config.json"),
    ("bad_config", "bad_config: cannot read the config.json \\(JSONDecodeError"),
    ("truncated_weights", "cannot read the weights \\(SafetensorError"),
    ("no_tokenizer", "has no tokenizer \\(none of tokenizer.json"),
    ("nonfinite", "the weight model.layers.1.mlp.up_proj.weight holds 1 NaN or Inf value\\(s\\) of \\d+; the checkpoint is damaged"),
])
def test_a_bad_model_is_one_line_with_exit_code_2(case, message, tmp_path, capsys):
    if case == "missing":
        path = tmp_path / "nowhere" / "model"
    elif case == "not_a_model":
        path = tmp_path / "notes"
        path.mkdir()
        (path / "readme.txt").write_text("not a model")
    elif case == "bad_config":
        path = broken(tmp_path, case)
        (path / "config.json").write_text("{not json")
    elif case == "truncated_weights":
        path = broken(tmp_path, case)
        (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:1000])
    elif case == "nonfinite":
        path = broken(tmp_path, case)
        weights = load_file(path / "model.safetensors")
        weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        path = broken(tmp_path, case, tokenizer=False)
    assert main(["eval", str(path), "--seq-len", "64"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in lines if line.startswith("moeify eval: error:")]) == 1
    assert "Traceback" not in "\n".join(lines)
    assert re.search(message, lines[-1]), lines[-1]
