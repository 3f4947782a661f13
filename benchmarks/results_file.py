"""The results file a benchmark appends its rows to (one JSON object per line) and prints its table from."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Print ``row`` and append it to ``path`` (created with its folder)."""
    print(json.dumps(row), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of ``path``, in the order they were measured."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def git_commit() -> str:
    """The checkout's commit, so that a row says which moeify measured it."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                          capture_output=True, text=True).stdout.strip()
