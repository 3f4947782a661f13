"""Perplexity with named, documented protocols.

``windows`` (default; the GPTQ/SparseGPT protocol): the text as-is, tokenized once (the tokenizer's BOS
only at the very start), cut into non-overlapping windows of ``seq_len`` tokens (the last one may be
shorter); each window is an independent sequence whose first token is not scored (it has no context);
the result is the token-weighted mean negative log-likelihood over every scored token.

A model loaded layer by layer (``moeify.offload``) is evaluated a decoder layer at a time over the
cached hidden states of every window (``calibration.stream.final_states``), with the same batches, so
the result equals the whole model's.

``bos-per-doc``: the same, but every document (a blank-line separated paragraph of a text file, a
record of a jsonl/json file) is tokenized on its own with its BOS, and the documents are concatenated.

``sliding``: windows of ``seq_len`` tokens that advance by ``stride``; every token is scored once, by
the first window in which it is not the first token, with up to ``seq_len - 1`` tokens of context (the
Hugging Face "perplexity of fixed-length models" recipe).

The logits are computed ``LOGIT_CHUNK`` scored positions at a time from the final hidden states
(``arch.head``: the model's own output head and logit transforms), so a batch of 8 x 2048 tokens of a
49,152-word vocabulary never holds its 3.2 GB of float32 logits at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from moeify.arch.head import final_hidden_states, output_head
from moeify.calibration.data import TextSource, token_stream
from moeify.calibration.stream import final_states
from moeify.offload import layered_of

Protocol = Literal["windows", "bos-per-doc", "sliding"]
PROTOCOLS: tuple[str, ...] = ("windows", "bos-per-doc", "sliding")
LOGIT_CHUNK = 1024  # scored positions whose logits exist at once


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float
    tokens: int          # scored tokens
    windows: int
    seq_len: int
    sha256: str
    protocol: str
    stride: int | None = None
    # per window, in evaluation order: its summed NLL and scored tokens (for paired comparisons; not recorded)
    window_nll: tuple[float, ...] = field(default=(), repr=False)
    window_tokens: tuple[int, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        del record["window_nll"], record["window_tokens"]
        return record


def relative_change(base: Perplexity, other: Perplexity) -> tuple[float, float | None]:
    """(other.ppl / base.ppl - 1, its standard error) of two models scored on the same windows (the error
    is None for a single window: there is no spread to measure).

    The error is the sampling error of the text, paired: the mean per-token NLL difference varies with
    which windows are scored, and windows are the independent units (a window's tokens share a context,
    and a change in a model's hard decisions, a router's or a threshold's, moves a whole window's losses
    together). Its standard error is that of a ratio of per-window sums, d_w - D t_w around the mean
    difference D, scaled to the relative perplexity change by exp(D). A model compared with itself
    scores (0, 0)."""
    if base.window_tokens != other.window_tokens or base.sha256 != other.sha256 or not base.window_tokens:
        raise ValueError("relative_change needs two evaluations of the same text in the same windows")
    tokens = torch.tensor(base.window_tokens, dtype=torch.float64)
    diff = torch.tensor(other.window_nll, dtype=torch.float64) - torch.tensor(base.window_nll, dtype=torch.float64)
    mean = float(diff.sum() / tokens.sum())  # other.nll - base.nll
    change = math.exp(mean)
    n = len(tokens)
    if n < 2:
        return change - 1, None
    residual = diff - mean * tokens
    stderr = math.sqrt(float((residual ** 2).sum()) * n / (n - 1)) / float(tokens.sum())
    return change - 1, change * stderr


def _stream(source: TextSource, tokenizer: Any, protocol: str) -> Tensor:
    if protocol != "bos-per-doc":
        return token_stream(source, tokenizer)
    docs = [doc for doc in source.text.split("\n\n") if doc.strip()]
    return torch.cat([token_stream(TextSource(source.name, doc), tokenizer) for doc in docs])


def _scored_windows(stream: Tensor, seq_len: int, stride: int | None) -> list[tuple[Tensor, int]]:
    """(window, number of leading positions not scored) pairs; the first token is never scored."""
    if stride is None:
        return [(w, 1) for w in stream.split(seq_len) if len(w) >= 2]
    windows, scored_until = [], 1  # tokens [0, scored_until) already scored (token 0 never is)
    for start in range(0, len(stream) - 1, stride):
        window = stream[start:start + seq_len]
        if len(window) < 2 or start + len(window) <= scored_until:
            continue
        windows.append((window, max(1, scored_until - start)))
        scored_until = start + len(window)
    return windows


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer: Any, source: TextSource, seq_len: int, *, protocol: str = "windows",
               stride: int | None = None, batch_size: int = 8, max_windows: int | None = None,
               progress: bool = False) -> Perplexity:
    """Evaluate ``model`` on ``source`` with ``protocol`` (see the module docstring)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not allowed; choose one of: {', '.join(PROTOCOLS)}")
    if (protocol == "sliding") != (stride is not None):
        raise ValueError("stride is required by, and only by, protocol='sliding'")
    if stride is not None and not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} is out of range; allowed: [1, {seq_len}] (seq_len)")
    windows = _scored_windows(_stream(source, tokenizer, protocol), seq_len, stride)[:max_windows]
    device = next(model.parameters()).device
    head = output_head(model)
    window_nll: list[float] = []
    window_tokens: list[int] = []
    groups: dict[tuple[int, int], list[Tensor]] = {}
    for window, skip in windows:  # equal shapes batch together
        groups.setdefault((len(window), skip), []).append(window)
    batches = [(torch.stack(ws[i:i + batch_size]), skip) for (_, skip), ws in groups.items()
               for i in range(0, len(ws), batch_size)]
    layered = None  # a model loaded layer by layer computes every batch's final states in one pass
    if layered_of(model) is not None:
        layered = final_states(model, [batch for batch, _ in batches], device, progress)
    for index, (batch, skip) in enumerate(tqdm(batches, desc=f"perplexity {source.name}", disable=not progress)):
        batch = batch.to(device)
        final = final_hidden_states(model, batch) if layered is None else layered[index]
        hidden = final[:, skip - 1:-1].flatten(0, 1)  # the positions predicting skip..
        targets = batch[:, skip:].flatten()
        losses = torch.cat([nn.functional.cross_entropy(head(h).float(), t, reduction="none")  # never a whole
                            for h, t in zip(hidden.split(LOGIT_CHUNK), targets.split(LOGIT_CHUNK))])  # batch's logits
        window_nll += losses.view(len(batch), -1).double().sum(dim=1).tolist()
        window_tokens += [batch.shape[1] - skip] * len(batch)
    total_tokens = sum(window_tokens)
    mean = math.fsum(window_nll) / total_tokens
    return Perplexity(ppl=math.exp(mean), nll=mean, tokens=total_tokens, windows=len(windows), seq_len=seq_len,
                      sha256=source.sha256, protocol=protocol, stride=stride, window_nll=tuple(window_nll),
                      window_tokens=tuple(window_tokens))
