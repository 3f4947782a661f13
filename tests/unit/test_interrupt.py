"""A signal stops a run even when Python swallows its KeyboardInterrupt (raised inside a finaliser)."""

import os
import signal
import sys

import pytest
import torch

from moeify.interrupt import interruptible, raise_if_interrupted
from moeify.training.loop import TrainPlan, train
from tests.helpers.tiny_models import tiny_model


class _SignalsWhenCollected:
    """Sends SIGTERM to this process from ``__del__``: the handler's KeyboardInterrupt is raised inside the
    finaliser, which Python prints as "Exception ignored" and drops."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

class _FailsWhenCollected:
    def __del__(self) -> None:
        raise ValueError("a finaliser's own error")


def test_a_signal_lost_in_a_finaliser_is_still_seen_at_the_next_safe_point():
    with interruptible():
        raise_if_interrupted()  # nothing asked yet
        _SignalsWhenCollected()  # collected at once: the KeyboardInterrupt is lost
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    raise_if_interrupted()  # the request ends with the run it interrupted


def test_the_lost_interrupt_is_not_printed_and_other_finaliser_errors_still_are(monkeypatch):
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: printed.append(type(unraisable.exc_value)))
    with interruptible():
        _SignalsWhenCollected()
        _FailsWhenCollected()
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    assert printed == [ValueError]
    _FailsWhenCollected()
    assert printed == [ValueError, ValueError]  # the run gave back the hook it found


def test_training_stops_after_the_step_that_lost_the_signal():
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = torch.randint(3, 128, (2000,), generator=torch.Generator().manual_seed(0))
    steps = []

    def after_step() -> None:
        steps.append(1)
        if len(steps) == 2:
            _SignalsWhenCollected()

    with interruptible(), pytest.raises(KeyboardInterrupt):
        train(model, optimizer, stream, TrainPlan(steps=6, batch_size=2, seq_len=8), seed=0,
              device=torch.device("cpu"), after_step=after_step, progress=False)
    assert len(steps) == 2


def test_sigint_is_left_alone_where_the_process_ignores_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interruptible():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
