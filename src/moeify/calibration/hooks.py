"""Hooks that exist only inside a ``with`` block and come off even when an exception escapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn


@contextmanager
def capture_inputs(module: nn.Module, observe: Callable[[Tensor], None]) -> Iterator[None]:
    """Call ``observe(x)`` with the first positional input of every ``module`` forward."""
    handle = module.register_forward_pre_hook(lambda _module, args: observe(args[0].detach()))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def observing(observers: dict[nn.Module, Callable[[Tensor, Any], None]]) -> Iterator[None]:
    """Call ``observers[module](x, output)`` after every forward of each module, x its first positional
    input (what the call returns is dropped: a forward hook's return value would replace the output)."""
    def hook(observe: Callable[[Tensor, Any], None]) -> Callable[..., None]:
        def call(_module: nn.Module, args: tuple, out: Any) -> None:
            observe(args[0].detach(), out)
        return call

    handles = [module.register_forward_hook(hook(observe)) for module, observe in observers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
