"""Output folders and the names every layer shares: atomic writes (nothing half-written is ever left where
the user asked for the output), a marker in every folder moeify writes (``--overwrite`` replaces only
those: never a folder moeify did not write), a lock per output (two runs never write the same folder),
permissions that follow the umask, and ``MOEIFY_KEY``, the config block that marks a model as moeify's."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

MOEIFY_KEY = "moeify"  # the block in a converted model's config.json that describes its MoE layers
MARKER = ".moeify"  # in every folder moeify writes: the files it wrote there, which --overwrite may replace
_LEGACY_MARKER = "written by moeify"  # the marker's text in earlier versions: the whole folder was moeify's


class OutputExistsError(FileExistsError):
    pass


class OutputLockedError(FileExistsError):
    pass


class NoSpaceError(ValueError):
    """The output's disk has too little free space for what the command will write there."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _listing_digest(files: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_marker(folder: Path, command: str, files: dict[str, int] | None = None) -> None:
    """Mark ``folder`` as moeify's: its marker names the command and every file moeify wrote there (path and
    size; default: every file in it) with a digest of that list, so that no marker comes about by accident
    (a copied or hand-made one does not match its own list)."""
    folder = Path(folder)
    if files is None:
        files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                 if p.is_file() and p.name != MARKER}
    marker = {"written_by": f"moeify {command}".strip(), "files": files, "digest": _listing_digest(files)}
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def moeify_files(folder: Path) -> set[str] | None:
    """The files moeify wrote into ``folder`` (paths relative to it), from its marker; every file for a marker
    of an earlier version; None where the folder has no valid marker (moeify did not write it)."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    text = marker.read_text(errors="replace")
    if text.startswith(_LEGACY_MARKER):
        return {str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file() and p.name != MARKER}
    try:
        data = json.loads(text)
        files, valid = data["files"], data["digest"] == _listing_digest(data["files"])
    except (ValueError, KeyError, TypeError):
        return None
    return set(files) if valid and str(data.get("written_by", "")).startswith("moeify") else None


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Fail before any heavy work when ``out`` would be clobbered without permission, is a folder moeify
    did not write (no valid marker: ``write_marker``), or cannot be written (a temporary sibling is created
    and removed)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not out.is_dir() or moeify_files(out) is None:
            raise OutputExistsError(f"{str(out)!r} exists and was not written by moeify (no valid {MARKER} marker "
                                    "in it); moeify replaces only its own outputs: choose another --out")
        if not overwrite:
            raise OutputExistsError(f"output folder {str(out)!r} exists (an earlier moeify output); pass "
                                    "--overwrite (overwrite=True) to replace it, or choose another --out")
    parent = _nearest_existing(Path(out).parent)
    try:
        Path(tempfile.mkdtemp(prefix=f".{out.name}.check-", dir=parent)).rmdir()
    except OSError as error:
        raise OutputExistsError(f"cannot write the output {str(out)!r}: {parent} is not writable "
                                f"({error.strerror})") from None


def check_free_disk(out: Path, needed: int, what: str, flag: str = "--out") -> None:
    """Refuse, before the work, an output whose disk has less free space than ``needed`` bytes (``what`` says
    what will be written). The files of a folder being replaced count as free: the new output takes their
    place, so the check refuses only what cannot fit even then."""
    out = Path(out)
    where = _nearest_existing(out.parent)
    free = shutil.disk_usage(where).free
    if out.is_dir():
        free += sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if free < needed:
        raise NoSpaceError(f"{flag} {str(out)!r}: {what} needs about {needed / 2**30:.2f} GiB and the disk at "
                           f"{where} has {free / 2**30:.2f} GiB free; free some space there or choose another {flag}")


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``<out>.lock`` for the block, so that a second run into the same output is refused with the
    first one's process id and command; a lock whose process is gone is taken over."""
    lock = Path(out).with_name(Path(out).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            holder = lock.read_text().split("\n", 1)
            if holder[0].isdigit() and _alive(int(holder[0])):
                raise OutputLockedError(f"{str(out)!r} is being written by process {holder[0]} "
                                        f"({holder[1].strip() if len(holder) > 1 else 'unknown command'}); "
                                        f"wait for it, or remove {lock} if that process is gone") from None
            lock.unlink(missing_ok=True)  # its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n{' '.join(sys.argv)}\n")
        break
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _follow_umask(folder: Path) -> None:
    """Folders 0777 and files 0666 less the umask, as any tool's output (mkdtemp makes 0700)."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _carry_over_(old: Path, new: Path) -> None:
    """Move every file of ``old`` that moeify did not write (its marker's list) into ``new``, so that replacing
    ``old`` by ``new`` removes only moeify's own files; one that ``new`` also holds is refused (it would be lost)."""
    ours = moeify_files(old) or set()
    theirs = [p for p in sorted(old.rglob("*")) if p.is_file() and p.name != MARKER
              and str(p.relative_to(old)) not in ours]
    clashes = [str(p.relative_to(old)) for p in theirs if (new / p.relative_to(old)).exists()]
    if clashes:
        raise OutputExistsError(f"{str(old)!r} holds {clashes[0]!r}, which moeify did not write and the new output "
                                "would replace: move it away, or choose another --out")
    for path in theirs:
        target = new / path.relative_to(old)
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporaries that a killed write of ``out`` left beside it (``.NAME.tmp-XXXXXXXX``, as
    ``atomic_dir`` and ``atomic_file`` name them): each run into ``out`` holds its lock, so none is in use."""
    pattern = re.compile(rf"\.{re.escape(Path(out).name)}\.tmp-[a-z0-9_]{{8}}")
    parent = Path(out).parent
    for path in parent.iterdir() if parent.is_dir() else ():
        if pattern.fullmatch(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


@contextmanager
def atomic_dir(out: Path, overwrite: bool = False, command: str = "") -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it is marked as moeify's (``command`` named in the
    marker) and replaces ``out`` (whose files moeify did not write move into it first), on error it is
    removed."""
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        write_marker(tmp, command)
        _follow_umask(tmp)
        if out.exists():
            _carry_over_(out, tmp)
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


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary file name beside ``path``; on success the file written there replaces ``path``, on
    error it is removed (a reader never sees a half-written file)."""
    path = Path(path)
    remove_stale_temporaries(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_WEIGHT = re.compile(r"(.+):(\d+(?:\.\d*)?|\.\d+)")


def split_weight(spec: str | Path) -> tuple[str, float | None]:
    """A data input as given and its ``:weight`` suffix (``A.txt:2`` -> ``("A.txt", 2.0)``), or None where it has
    none. A file whose own name ends that way is read as named."""
    text = str(spec)
    match = _WEIGHT.fullmatch(text)
    if match is None or Path(text).exists():
        return text, None
    return match.group(1), float(match.group(2))


def _inputs(inputs: Iterable[str | Path | None]) -> list[Path]:
    """The inputs that are local paths (hub names and ``embedded:`` names have none; a data file's ``:weight``
    dropped), resolved."""
    paths = [Path(split_weight(item)[0]) for item in inputs if item is not None]
    return [path.resolve() for path in paths if path.exists()]


def check_not_an_input(out: Path, inputs: Iterable[str | Path | None], flag: str = "--out") -> None:
    """Refuse, before any work, an output that is one of the command's inputs, holds one or lies inside
    one: writing it would replace or change what the command reads (``--overwrite`` included)."""
    target = Path(out).resolve()
    for source in _inputs(inputs):
        if target == source or source.is_relative_to(target) or target.is_relative_to(source):
            where = "is" if target == source else "holds" if source.is_relative_to(target) else "lies inside"
            raise OutputExistsError(f"{flag} {str(out)!r} {where} {str(source)!r}, which this command reads: "
                                    f"choose a {flag} outside its inputs")


def check_output_file(path: Path, overwrite: bool, inputs: Iterable[str | Path | None] = (),
                      flag: str = "--json") -> None:
    """Refuse, before any work, a results file that is an input, a folder, an existing file without
    ``overwrite``, or in a folder that cannot be written."""
    path = Path(path)
    check_not_an_input(path, inputs, flag)
    if path.is_dir():
        raise OutputExistsError(f"{flag} {str(path)!r} is a folder; give a file name")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{flag} {str(path)!r} exists; pass --overwrite to replace it, or choose another name")
    parent = _nearest_existing(path.parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise OutputExistsError(f"cannot write {flag} {str(path)!r}: {parent} is not a writable folder")


def write_output_file(path: Path, text: str) -> None:
    """Write a results file atomically (its folder made first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(text)
