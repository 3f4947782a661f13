"""The JSON record every command writes next to its output (reports read these, nothing else)."""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_NAME = "record.json"


@dataclass(frozen=True)
class ConversionRecord:
    """What ``moeify convert`` and ``moeify recover`` write as ``record.json`` beside a converted model (its
    JSON form, ``as_dict``, is what ``ConversionResult.record`` holds and what reports read).

    ``config``: the method's options and the run's (seed, device, dtype, processes); ``data``: the
    calibration and evaluation texts by name and sha256; ``metrics``: the dense and converted perplexities
    on the evaluation text, and the change with its sampling error; ``active``: the activated parameters
    measured on the evaluation tokens (``moe.accounting``); ``paper_ratio``: the activated ratio as the
    method's paper counts it; ``nominal_active``: the ratio by expert sizes alone (None where routing
    decides it); ``routing``: per routed layer, its load and JSD to uniform; ``speed``: the converted model
    against the dense one in the same process (None when not measured); ``timings``: seconds of the
    conversion, the recovery and the analysis; ``memory``: the plan's peak against the measured ones;
    ``artifacts``: the files written beside the record; ``details``: the method's own (``Conversion``);
    ``pre_recovery`` / ``recovery``: a recovered run's measurements before it and the recovery's log;
    ``bench``: the latest ``moeify bench`` of the folder, eager and compiled, each in its own slot."""

    method: str
    paper: str
    model: str
    config: dict[str, Any]
    data: dict[str, Any]
    metrics: dict[str, Any]
    active: dict[str, Any]
    paper_ratio: dict[str, Any]
    nominal_active: dict[str, Any] | None
    routing: list[dict[str, Any]]
    speed: dict[str, Any] | None
    timings: dict[str, float]
    memory: dict[str, Any]
    artifacts: list[str]
    details: dict[str, Any]
    pre_recovery: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    versions: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    bench: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: every field, but those of a recovery and a bench the run has not had."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.name in ("pre_recovery", "recovery", "bench") and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: object = "record") -> ConversionRecord:
        """The record a run folder holds; one that lacks a field is not a conversion record (an error that
        names the field)."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ValueError(f"{source}: not a conversion record (no {', '.join(missing)})")
        return cls(**{key: value for key, value in raw.items() if key in names})


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


def read_conversion_record(folder: Path) -> ConversionRecord:
    """The record of a folder ``moeify convert`` (or ``recover``) wrote."""
    return ConversionRecord.from_dict(read_record(folder), Path(folder) / RECORD_NAME)


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
