"""Perplexity with one documented protocol.

``windows`` (default): the text as-is, tokenized once (the tokenizer's BOS only at the very start), cut
into non-overlapping windows of ``seq_len`` tokens (the last one may be shorter); each window is an
independent sequence, its first token is not scored (it has no context), and the result is the
token-weighted mean negative log-likelihood over every scored token. This is the GPTQ/SparseGPT
protocol, except that the tail is kept and no token is scored without context.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from moeify.calibration.data import TextSource, token_stream

PROTOCOL = "windows: tokenized once, BOS at start only, non-overlapping, first token of each window unscored"


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float
    tokens: int          # scored tokens
    windows: int
    seq_len: int
    sha256: str
    protocol: str = PROTOCOL

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer: Any, source: TextSource, seq_len: int, *, batch_size: int = 8,
               max_windows: int | None = None, progress: bool = False) -> Perplexity:
    """Evaluate ``model`` on ``source`` with the ``windows`` protocol (see the module docstring)."""
    stream = token_stream(source, tokenizer)
    windows = list(stream.split(seq_len))
    if len(windows[-1]) < 2:
        windows.pop()
    if max_windows is not None:
        windows = windows[:max_windows]
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    full = [w for w in windows if len(w) == seq_len]
    groups = [torch.stack(full[i:i + batch_size]) for i in range(0, len(full), batch_size)]
    groups += [w[None] for w in windows if len(w) != seq_len]
    for batch in tqdm(groups, desc=f"perplexity {source.name}", disable=not progress):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                          reduction="sum")
        total_nll += float(nll)
        total_tokens += batch[:, 1:].numel()
    mean = total_nll / total_tokens
    return Perplexity(ppl=math.exp(mean), nll=mean, tokens=total_tokens, windows=len(windows), seq_len=seq_len,
                      sha256=source.sha256)
