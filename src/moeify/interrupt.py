"""Ending a long run on Ctrl-C or SIGTERM, even when the first ``KeyboardInterrupt`` is lost.

Python raises a signal handler's exception in whatever code the main thread runs at that moment. When that
is a finaliser (a ``__del__``, a weak-reference callback, the garbage collector), Python prints it as
"Exception ignored" and carries on, so a run could ignore its one SIGTERM and train to the end. The handler
therefore also records the request, and the training loop calls ``raise_if_interrupted`` between steps. While a
request is recorded, a lost ``KeyboardInterrupt`` is not printed: the run still ends at the next safe point with
its one-line message, and a traceback from some library's finaliser would only bury it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

_requested = False


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: cleanly, with the resume hint


UnraisableHook = Callable[["sys.UnraisableHookArgs"], object]


def _quiet_lost_interrupt(previous: UnraisableHook) -> UnraisableHook:
    """An unraisable hook that drops the handler's own lost ``KeyboardInterrupt`` and passes on the rest."""

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if _requested and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        previous(unraisable)

    return hook


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if a signal asked this run to stop (a safe point's check)."""
    if _requested:
        raise KeyboardInterrupt


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM, and SIGINT unless this process ignores it (a background job), stop the code inside."""
    global _requested
    _requested = False
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signals.append(signal.SIGINT)
    previous = {signum: signal.signal(signum, _interrupt) for signum in signals}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_lost_interrupt(previous_hook)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = previous_hook
        _requested = False
