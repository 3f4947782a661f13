"""The JSON record every command writes next to its output (reports read these, nothing else)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

RECORD_NAME = "record.json"


def library_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    from moeify.version import __version__

    return {"moeify": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "python": platform.python_version()}


def write_record(record: dict[str, Any], path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")
    return path


def read_record(folder: Path) -> dict[str, Any]:
    """The record of a run folder; a folder without one is not a moeify run (an error that says so)."""
    path = Path(folder) / RECORD_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {RECORD_NAME} (not a moeify run folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None


def describe_change(change: float, stderr: float | None) -> str:
    """A perplexity change as a record holds it (``perplexity.relative_change``) as text: "+4.20 % +- 0.86 %"
    (no error for a single window)."""
    return f"{100 * change:+.2f} %" + ("" if stderr is None else f" +- {100 * stderr:.2f} %")
