"""Run saved folders through ``AutoModelForCausalLM.from_pretrained`` in a fresh process where importing
moeify fails: a native folder computes with its copied runtime files only (``trust_remote_code``), an
exported one with transformers' own classes only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


def plain_logits(folders: dict[str, Path], probes: dict[str, torch.Tensor], work: Path, *,
                 trust_remote_code: bool) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """{folder name: (model class name, {probe name: logits})}, all computed in one fresh process."""
    torch.save(probes, work / "probes.pt")
    paths = {name: str(path) for name, path in folders.items()}
    script = (
        "import sys, torch; sys.modules['moeify'] = None\n"  # importing moeify would now fail
        "from transformers import AutoModelForCausalLM\n"
        f"probes, out = torch.load({str(work / 'probes.pt')!r}), {{}}\n"
        f"for name, path in {paths!r}.items():\n"
        f"    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code={trust_remote_code}).eval()\n"
        "    with torch.no_grad():\n"
        "        out[name] = (type(model).__name__, {k: model(v).logits for k, v in probes.items()})\n"
        f"torch.save(out, {str(work / 'logits.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=work)
    return torch.load(work / "logits.pt")


def logits_without_moeify(folder: Path, ids: torch.Tensor, work: Path) -> torch.Tensor:
    """The logits of the native folder ``folder`` on ``ids``, computed without moeify."""
    return plain_logits({"native": folder}, {"ids": ids}, work, trust_remote_code=True)["native"][1]["ids"]
