"""Plain-text tables for the terminal."""

from __future__ import annotations


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(title)
    print("-" * (width + 2 + max(len(v) for _, v in rows)))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
