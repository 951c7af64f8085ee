"""Other threads' calls of a model while it is exported.

torch.export swaps the traced model's parameters and buffers for fake tensors on the model
object itself, and torch.fx patches ``nn.Module.__call__`` for the whole process: a call of one
of its modules from another thread meanwhile computes with fakes (a FakeTensor returned, an
AssertionError from fake mode) or breaks the export. ``held`` keeps such calls out of the
export's span: the export starts once the calls of its model already running in other threads
have ended, and new ones wait for it to end.

A call from another thread that is given the trace's own tensors is the traced function's work
done on a thread pool: a trace follows one thread, so that call raises ``InOtherThread`` (the
export fails saying why) instead of waiting for an export that waits for it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

# How long an export waits for calls already running in other threads to end. One that is still
# running then may itself wait on the export's thread (a compiled function it calls): the export
# goes ahead, and that call sees fakes only if it reads a weight without calling a module.
DRAIN_FOR = 10.0
_POLL = 0.002


class InOtherThread(RuntimeError):
    """A module of the traced model was called from another thread with the trace's tensors."""


@contextlib.contextmanager
def held(traced: torch.nn.Module) -> Iterator[None]:
    """While the block runs, other threads' calls of ``traced``'s modules wait for it to end,
    and it starts once those already running have ended (see the module's doc)."""
    mine = frozenset(id(m) for m in traced.modules())
    gate = _Gate(mine, threading.get_ident())
    original = torch.nn.Module.__call__
    torch.nn.Module.__call__ = gate.wrap(original)
    try:
        gate.drain()
        yield
    finally:
        if torch.nn.Module.__call__ is gate.wrapped:  # not replaced by someone else since
            torch.nn.Module.__call__ = original
        gate.open()


class _Gate:
    def __init__(self, mine: frozenset[int], here: int) -> None:
        self.mine, self.here = mine, here
        self.draining = True
        self.done = threading.Event()
        self.wrapped: Callable[..., Any] | None = None

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def gated(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if id(module) in self.mine and not self.done.is_set() and threading.get_ident() != self.here:
                self.wait(module, args, kwargs)
            return call(module, *args, **kwargs)

        self.wrapped = gated
        return gated

    def wait(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if _traced_tensor(args, kwargs):
            raise InOtherThread(
                f"a module of the traced model ({type(module).__name__}) was called from another thread with the "
                "trace's tensors (a forward that runs its modules on a thread pool?): a trace follows one thread, "
                "so this function cannot be exported")
        if self.draining and _inside(sys._getframe(), self.mine):
            return  # a call running since before the export: it ends first
        self.done.wait()

    def drain(self) -> None:
        deadline = time.monotonic() + DRAIN_FOR
        while time.monotonic() < deadline and _running_elsewhere(self.mine, self.here):
            time.sleep(_POLL)
        self.draining = False

    def open(self) -> None:
        self.done.set()


_CALLS = frozenset(
    f.__code__ for f in (torch.nn.Module.__call__, getattr(torch.nn.Module, "_call_impl", None),
                         getattr(torch.nn.Module, "_wrapped_call_impl", None)) if hasattr(f, "__code__")
)


def _inside(frame: Any, mine: frozenset[int]) -> bool:
    """Whether a frame, or one it was called from, is a call of one of the modules in ``mine``."""
    while frame is not None:
        if frame.f_code in _CALLS and id(frame.f_locals.get("self")) in mine:
            return True
        frame = frame.f_back
    return False


def _running_elsewhere(mine: frozenset[int], here: int) -> bool:
    return any(_inside(frame, mine) for thread, frame in sys._current_frames().items() if thread != here)


def _traced_tensor(args: tuple, kwargs: dict) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(leaf, FakeTensor) for leaf in torch.utils._pytree.tree_leaves((args, kwargs)))
