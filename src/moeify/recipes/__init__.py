"""Each paper's headline table as a recipe: the rows' methods and options, with the paper's model, setting
and figures as metadata. ``moeify compare --recipe NAME|FILE [MODEL]`` converts MODEL once per row and
prints the rows beside the paper's figures (``recipes.table``): with the paper's model and budget it
reproduces the table's setting; on a small model it shows which of the paper's orderings hold there.

A recipe is a JSON file (the shipped ones sit beside this module; any other path works too):
``title``, ``paper`` (the method whose paper it is), ``source`` (the table), ``model`` (the paper's, a hub
name), ``setting`` (the paper's data and budget, prose), ``metric`` (the paper's column that the held-out
perplexity ranks against) and ``lower_is_better``, ``columns`` (figure key -> the paper's header),
``dense`` (the paper's dense row) and ``rows``: ``name``, ``label`` (the paper's), ``method`` (null for a
row moeify does not implement, e.g. another paper's baseline: shown, not run), ``options`` and ``paper``
(its figures). A recipe is validated whole, options included, before any work.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

_NAME = re.compile(r"[a-z0-9_.]+")
_KEYS = ("title", "paper", "source", "model", "setting", "metric", "lower_is_better", "columns", "dense", "rows")


@dataclass(frozen=True)
class RecipeRow:
    name: str
    label: str
    method: str | None  # None: a row of the paper moeify does not run (its figures are shown)
    options: dict[str, Any] = field(default_factory=dict)
    paper: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    title: str
    paper: str
    source: str
    model: str
    setting: str
    metric: str
    lower_is_better: bool
    columns: dict[str, str]
    dense: dict[str, float]
    rows: tuple[RecipeRow, ...]

    @property
    def runs(self) -> list[RecipeRow]:
        """The rows moeify converts."""
        return [row for row in self.rows if row.method is not None]


def recipe_names() -> list[str]:
    """The recipes shipped with moeify (``--recipe NAME``)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".json"))


def load_recipe(spec: str | Path) -> Recipe:
    """The recipe named ``spec`` (a shipped one) or in the file ``spec``, validated (``check_recipe``)."""
    shipped = resources.files(__name__).joinpath(f"{spec}.json")
    if shipped.is_file():
        text, where = shipped.read_text(encoding="utf-8"), str(spec)
    elif Path(spec).is_file():
        text, where = Path(spec).read_text(encoding="utf-8"), str(spec)
    else:
        raise ValueError(f"--recipe {spec!r} is neither a shipped recipe ({', '.join(recipe_names())}) nor a file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"recipe {where}: not valid JSON (line {error.lineno}: {error.msg})") from None
    return check_recipe(data, where)


def check_recipe(data: Any, where: str) -> Recipe:
    """A ``Recipe`` from parsed JSON, or a one-line error naming the recipe and what is wrong: a missing key,
    a bad or repeated row name, an unknown method, an option the method refuses."""
    from moeify.methods import get_method
    from moeify.options import build_config

    if not isinstance(data, dict) or (missing := [k for k in _KEYS if k not in data]):
        raise ValueError(f"recipe {where}: needs the keys {', '.join(_KEYS)}"
                         + (f"; missing: {', '.join(missing)}" if isinstance(data, dict) else ""))
    rows, seen = [], set()
    for raw in data["rows"]:
        row = RecipeRow(raw["name"], raw.get("label", raw["name"]), raw.get("method"), raw.get("options", {}),
                        raw.get("paper", {}))
        if not _NAME.fullmatch(row.name) or row.name in seen:
            raise ValueError(f"recipe {where}: row name {row.name!r} must be unique and of a-z, 0-9, _ and .")
        seen.add(row.name)
        if row.method is not None:
            try:
                build_config(get_method(row.method).config_cls, row.options)
            except ValueError as error:
                raise ValueError(f"recipe {where}, row {row.name}: {error}") from None
        rows.append(row)
    if not any(row.method for row in rows):
        raise ValueError(f"recipe {where}: no row names a moeify method; nothing to run")
    return Recipe(**{key: data[key] for key in _KEYS if key != "rows"}, rows=tuple(rows))
