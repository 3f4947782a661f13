"""A small language-modelling training loop: next-token loss on token windows, one optimizer step per
batch, a progress bar, and a callback after every step (for e.g. load-balancing bias updates)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | int | list[float]]:
        return {"steps": len(self.losses), "first_loss": self.losses[0], "last_loss": self.losses[-1],
                "losses": [round(x, 5) for x in self.losses]}


def random_windows(stream: Tensor, seq_len: int, batch_size: int, generator: torch.Generator) -> Tensor:
    """A batch of ``batch_size`` random windows of ``seq_len`` tokens from ``stream``: (batch, seq_len)."""
    if len(stream) <= seq_len:
        raise ValueError(f"training text has {len(stream)} tokens, fewer than seq_len={seq_len} + 1")
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=generator)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def train_lm(model: nn.Module, optimizer: torch.optim.Optimizer, next_batch: Callable[[], Tensor], steps: int, *,
             device: torch.device, after_step: Callable[[], None] | None = None, progress: bool = True,
             desc: str = "training") -> TrainLog:
    """Run ``steps`` optimizer steps of causal-LM loss on batches from ``next_batch``."""
    log = TrainLog()
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=not progress)
    for _ in bar:
        batch = next_batch().to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        log.losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{log.losses[-1]:.4f}")
    model.eval()
    return log
