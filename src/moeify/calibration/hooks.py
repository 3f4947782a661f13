"""Hooks that exist only inside a ``with`` block and come off even when an exception escapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn


@contextmanager
def capture_inputs(module: nn.Module, observe: Callable[[Tensor], None]) -> Iterator[None]:
    """Call ``observe(x)`` with the first positional input of every ``module`` forward."""
    handle = module.register_forward_pre_hook(lambda _module, args: observe(args[0].detach()))
    try:
        yield
    finally:
        handle.remove()
