"""Interrupt a training run part-way, as a kill would, to test resuming from its checkpoints."""

from __future__ import annotations

from moeify.training import loop


def kill_in_step(monkeypatch, step: int) -> None:
    """Make the training loop raise KeyboardInterrupt when it draws the batch of optimizer step ``step``
    (1-based); ``monkeypatch.undo()`` restores it."""
    real, calls = loop.random_windows, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt(f"killed in step {step}")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "random_windows", dying)
