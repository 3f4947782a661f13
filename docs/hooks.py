"""MkDocs hook: the repository's README.md is the site's home page, so the two never differ. Its links into
``docs/`` become links between pages; a link to a file outside ``docs/`` (CONTRIBUTING.md, a source file)
points at that file in the repository, which the site does not hold, so it is rendered as its path."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config) -> Files:  # noqa: ANN001 - MkDocs' hook signature
    files.append(File.generated(config, "index.md", content=(ROOT / "README.md").read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - MkDocs' hook signature
    if page.file.src_uri != "index.md":
        return markdown
    markdown = markdown.replace("](docs/", "](")
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)]+)\)",
                  lambda m: m.group(0) if (ROOT / "docs" / m.group(2).split("#")[0]).is_file() else f"`{m.group(2)}`"
                  if m.group(1) == m.group(2) else f"{m.group(1)} (`{m.group(2)}`)", markdown)
