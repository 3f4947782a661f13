"""Typed, frozen method configurations built from ``--set KEY=VALUE`` strings.

Every option is a dataclass field with a ``help`` and, where it has one, an allowed range, so that bad
input fails before any heavy work with the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args, get_origin

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


@dataclasses.dataclass(frozen=True)
class Training:
    """A method's training phase as its options declare it (``MethodOptions.training``): what the memory plan
    counts, and what keeps a conversion from running layer by layer. ``lora``: LoRA adapters train (their
    parameters, below 1 % of the model, are not counted), else the method's own parameters (all of them
    unless its memory estimate says which). ``batch_size`` sequences of ``seq_len`` tokens per optimizer
    step, in ``grad_accum`` micro-batches; ``recompute``: activation checkpointing."""

    lora: bool
    batch_size: int
    grad_accum: int
    seq_len: int
    recompute: bool


@dataclasses.dataclass(frozen=True)
class Shorthand:
    """An option that stands for several (CMoE's ``spec=S1A1E8`` for num_shared, top_k and num_experts):
    ``build_config`` expands it before the config is built, so that a config holds each setting once and
    never rewrites its own fields. ``expand`` raises ``OptionError`` for a malformed value; ``after``: the
    option it is listed after in ``moeify methods``."""

    name: str
    help: str
    expand: Callable[[str], dict[str, Any]]
    after: str


class MethodOptions:
    """What every method config declares beside its options, so that the commands ask each config the same
    questions: the calibration windows it draws, the training it runs for a given model, and the shorthands
    it accepts."""

    shorthands: ClassVar[tuple[Shorthand, ...]] = ()

    def calibration_windows(self, model_config: PreTrainedConfig) -> tuple[int, int]:
        """(windows, tokens per window) of calibration text the conversion draws for this model, checked
        against the text before any model work: none by default."""
        return 0, 0

    def training(self, model_config: PreTrainedConfig) -> Training | None:
        """The training this conversion runs on this model: None (training-free) by default."""
        return None


class OptionError(ValueError):
    pass


def option(default: Any, help: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> Any:
    """A config field with its help text and an optional numeric range [low, high] ((low, high] if
    ``low_open``)."""
    return dataclasses.field(default=default, metadata={"help": help, "low": low, "high": high,
                                                        "low_open": low_open})


def require_at_most(name: str, value: int | None, limit: int, what: str) -> None:
    """Model-dependent upper bounds: ``seq_len=4096 must be <= the model's context (512)``."""
    if value is not None and value > limit:
        raise OptionError(f"{name}={value} must be <= {what} ({limit})")


def require_multiple(name: str, value: int, of: str, divisor: int) -> None:
    """A batch split into micro-batches: ``batch_size=6 must be a multiple of grad_accum=4``."""
    if value % divisor:
        raise OptionError(f"{name}={value} must be a multiple of {of}={divisor}")


def require_work_dir_for_resume(resume: bool, work_dir: object) -> None:
    """``resume=true`` continues from checkpoints, which live in the work folder: without one, say where
    it comes from instead of starting over silently."""
    if resume and work_dir is None:
        raise OptionError("resume=true needs a work folder with checkpoints (moeify convert keeps it beside "
                          "--out as <out>.work; in Python pass convert(work_dir=...))")


def _convert(name: str, raw: Any, annotation: Any) -> Any:
    """Turn a ``--set`` string (or an already typed value) into the field's type."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(name, raw, inner[0])
    if origin is Literal:
        if raw not in args:
            raise OptionError(f"{name}={raw!r} is not allowed; choose one of: {', '.join(map(str, args))}")
        return raw
    try:
        if annotation is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if annotation is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        return annotation(raw)
    except (TypeError, ValueError):
        raise OptionError(f"{name}={raw!r} is not a valid {annotation.__name__}") from None


def parse_bool(name: str, raw: Any) -> bool:
    """A boolean option value (true/false, yes/no, on/off, 1/0) or an ``OptionError`` naming it."""
    return _convert(name, raw, bool)


def method_config(cls: type) -> type:
    """Make ``cls`` a method's configuration: a frozen dataclass that checks itself when constructed, from
    the CLI or the Python API alike. Its ``__post_init__`` checks every field's range, then runs the class's
    own ``validate()`` (cross-field rules) if it has one."""

    def __post_init__(self: Any) -> None:
        for f in dataclasses.fields(self):
            _check_range(f.name, getattr(self, f.name), dict(f.metadata))
        if hasattr(self, "validate"):
            self.validate()

    cls.__post_init__ = __post_init__
    return dataclasses.dataclass(frozen=True)(cls)


def _check_range(name: str, value: Any, meta: dict[str, Any]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise OptionError(f"{name}={value} is not a finite number")
    low, high = meta.get("low"), meta.get("high")
    if value is None or isinstance(value, bool) or (low is None and high is None):
        return
    below = low is not None and (value <= low if meta.get("low_open") else value < low)
    above = high is not None and value > high
    if below or above:
        left = "(" if meta.get("low_open") else "["
        span = f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise OptionError(f"{name}={value} is out of range; allowed: {span}")


def _fields(config_cls: type) -> list[dataclasses.Field]:
    """The config's fields, its own first, then those of its parent, ... (shared fine-tuning options last)."""
    def depth(f: dataclasses.Field) -> int:
        return next(i for i, c in enumerate(config_cls.__mro__) if f.name in inspect.get_annotations(c))

    return sorted(dataclasses.fields(config_cls), key=depth)


def build_config(config_cls: type, overrides: dict[str, Any]) -> Any:
    """The config with ``overrides`` (``--set`` strings or typed values) converted to the fields' types, its
    shorthands expanded (their values win over the options they stand for); unknown keys and bad values
    raise ``OptionError`` (ranges: the config checks them itself)."""
    fields = {f.name: f for f in _fields(config_cls)}
    shorthands = {s.name: s for s in _shorthands(config_cls)}
    unknown = sorted(set(overrides) - set(fields) - set(shorthands))
    if unknown:
        raise OptionError(f"unknown option(s) {', '.join(unknown)} for {config_cls.__name__}; "
                          f"options: {', '.join([*fields, *shorthands])}")
    expanded = {key: raw for key, raw in overrides.items() if key not in shorthands}
    for name, raw in overrides.items():
        if name in shorthands and raw is not None and str(raw).lower() not in ("", "none", "null"):
            expanded.update(shorthands[name].expand(str(raw)))
    hints = typing.get_type_hints(config_cls)
    return config_cls(**{key: _convert(key, raw, hints[key]) for key, raw in expanded.items()})


def _shorthands(config_cls: type) -> tuple[Shorthand, ...]:
    return config_cls.shorthands if issubclass(config_cls, MethodOptions) else ()


def describe(config_cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) for every option, for ``moeify methods``: the class's own options first,
    then those it inherits (shared fine-tuning options)."""
    hints = typing.get_type_hints(config_cls)
    rows = []
    for f in _fields(config_cls):
        kind = hints[f.name]
        text = "|".join(map(str, get_args(kind))) if get_origin(kind) is Literal else getattr(kind, "__name__", str(kind))
        rows.append((f.name, text.replace("typing.", ""), f.default, f.metadata.get("help", "")))
        rows += [(s.name, "str | None", None, s.help) for s in _shorthands(config_cls) if s.after == f.name]
    return rows


def parse_assignments(pairs: list[str]) -> dict[str, str]:
    """``["top_k=2", "spec=S1A1E8"]`` -> ``{"top_k": "2", "spec": "S1A1E8"}``."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"--set expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out
