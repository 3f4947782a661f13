"""Output folders and the names every layer shares: atomic writes (nothing half-written is ever left where
the user asked for the output) and ``MOEIFY_KEY``, the config block that marks a model as moeify's."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MOEIFY_KEY = "moeify"  # the block in a converted model's config.json that describes its MoE layers


class OutputExistsError(FileExistsError):
    pass


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Fail before any heavy work when ``out`` would be clobbered without permission."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"output folder {str(out)!r} exists and is not empty; pass --overwrite "
                                "(overwrite=True) to replace it, or choose another --out")


@contextmanager
def atomic_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it replaces ``out``, on error it is removed."""
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(trash / out.name)
        tmp.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(out)
