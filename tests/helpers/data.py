"""The ../shared assets (absent on some machines) and the held-out TinyStories slice cut from them."""

from __future__ import annotations

from pathlib import Path

SHARED = Path(__file__).resolve().parents[3] / "shared" / "assets"

EMBEDDED_PARAGRAPHS = 567  # tinystories_calib.txt + tinystories_eval.txt are paragraphs [0, 567) of the dev file


def write_held_out(shared: Path, folder: Path, paragraphs: int = 600) -> Path:
    """Write ``paragraphs`` TinyStories paragraphs of ``shared``'s dev file that are in neither embedded
    slice (never calibrated on) to ``folder/tinystories_heldout.txt``; returns that path."""
    text = (shared / "data" / "tinystories" / "tinystories_valid_dev.txt").read_text()
    held_out = text.split("\n\n")[EMBEDDED_PARAGRAPHS:]
    path = folder / "tinystories_heldout.txt"
    path.write_text("\n\n".join(held_out[:paragraphs]))
    return path
