"""The teacher of a distillation: the dense model run alongside the student, or its top-k logits cached.

``LiveTeacher`` runs the teacher model on each batch (without gradients) and gives its final hidden states
(the whole vocabulary's distribution, through its own output head) or, with ``k``, its top-k targets
(``losses.top_k_targets``). ``TeacherCache`` holds the top-k targets of a fixed set of windows in one
safetensors file, written once (``build_teacher_cache``) and read a window at a time; windows are looked up
by their tokens, since the teacher's output is a function of them alone. A cache pays where the same
windows are distilled more than once: a budget larger than the text, or several conversions of one model
recovered on the same text (``moeify compare``); a one-pass run computes the same teacher passes either
way, plus the file, so it runs the teacher live.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from moeify.arch.head import final_hidden_states, output_head
from moeify.files import atomic_file
from moeify.training.losses import CHUNK_TOKENS, top_k_targets


class LiveTeacher:
    """The teacher model run on each batch: ``(hidden,)`` with ``k = 0``, else its top-k targets."""

    def __init__(self, model: nn.Module, k: int) -> None:
        self.model, self.k = model.eval(), k
        self.head = output_head(model)

    @torch.no_grad()
    def __call__(self, batch: Tensor) -> tuple[Tensor, ...]:
        hidden = final_hidden_states(self.model, batch)
        if not self.k:
            return (hidden,)
        return top_k_of_hidden(self.head, hidden, self.k)


def top_k_of_hidden(head: nn.Module, hidden: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``top_k_targets`` of hidden states (batch, seq, d), a chunk of tokens at a time (never the whole
    batch's logits): (batch, seq, k) log-probabilities, (batch, seq, k) ids, (batch, seq) tail."""
    flat = hidden.flatten(0, 1)
    parts = [top_k_targets(head(chunk), k) for chunk in flat.split(CHUNK_TOKENS)]
    top, ids, tail = (torch.cat(p) for p in zip(*parts))
    shape = hidden.shape[:2]
    return top.view(*shape, k), ids.view(*shape, k), tail.view(shape)


def cache_key(**identity: Any) -> str:
    """A file name for the cache of the teacher and windows that ``identity`` names (JSON-serialisable)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"teacher-top{identity.get('k')}-{digest}.safetensors"


def _key(window: Tensor) -> bytes:
    return window.to("cpu", torch.int64).numpy().tobytes()


def build_teacher_cache(model: nn.Module, windows: Tensor, k: int, path: Path, *, batch_size: int,
                        device: torch.device, progress: bool = False) -> Path:
    """Run ``model`` once over the distinct ``windows`` (n, seq) and write their top-k targets to ``path``
    (atomically: a killed build leaves no file); an existing file is kept."""
    if path.is_file():
        return path
    unique = torch.unique(windows, dim=0)
    teacher = LiveTeacher(model, k)
    tops, ids, tails = [], [], []
    for start in tqdm(range(0, len(unique), batch_size), desc="teacher top-k cache", disable=not progress):
        top, index, tail = teacher(unique[start:start + batch_size].to(device))
        tops.append(top.cpu())
        ids.append(index.to("cpu", torch.int32))
        tails.append(tail.cpu())
    tensors = {"windows": unique.to(torch.int64).contiguous(), "top": torch.cat(tops).contiguous(),
               "ids": torch.cat(ids).contiguous(), "tail": torch.cat(tails).contiguous()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"k": str(k)})
    return path


class TeacherCache:
    """A ``build_teacher_cache`` file, read a window at a time: ``cache(batch)`` gives the batch's top-k
    targets on the batch's device. A window the file does not hold is an error (a cache built for other
    windows)."""

    def __init__(self, path: Path) -> None:
        self.file = safe_open(str(path), framework="pt")
        self.k = int(self.file.metadata()["k"])
        self.rows = {_key(window): row for row, window in enumerate(self.file.get_tensor("windows"))}
        self.path = path

    def __call__(self, batch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        try:
            rows = [self.rows[_key(window)] for window in batch]
        except KeyError:
            raise ValueError(f"the teacher cache {self.path} does not hold this window: it was built for other "
                             "windows; delete it to rebuild") from None
        read = [[self.file.get_slice(name)[row] for row in rows] for name in ("top", "ids", "tail")]
        top, ids, tail = (torch.stack(r).to(batch.device) for r in read)
        return top, ids.long(), tail
