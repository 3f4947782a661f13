"""Run a saved native folder through ``AutoModelForCausalLM(trust_remote_code=True)`` in a fresh process
where importing moeify fails, so only the copied runtime files can compute the logits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


def logits_without_moeify(folder: Path, ids: torch.Tensor, work: Path) -> torch.Tensor:
    torch.save(ids, work / "ids.pt")
    script = (
        "import sys, torch; sys.modules['moeify'] = None\n"  # importing moeify would now fail
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()\n"
        f"ids = torch.load({str(work / 'ids.pt')!r})\n"
        f"torch.save(m(ids).logits.detach(), {str(work / 'logits.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=work)
    return torch.load(work / "logits.pt")
