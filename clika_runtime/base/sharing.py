"""Eager calls and exports take turns, process-wide: ``TARGETS``.

While torch.export traces, torch.fx patches ``torch.nn.Module.__call__`` for the whole process
and swaps the traced module's parameters for fake tensors: an eager module call from another
thread at that moment runs through the tracer (and breaks the export, or computes with fakes).
So every eager call of a compiled function's target holds ``TARGETS`` shared (any number at
once, across functions), and an export holds it exclusive; an export waiting for its turn is
served before new eager calls. Hits never take it: they run graphs, not modules.

A thread that already holds it shared (a target calling its own compiled function) gets it again
at once and must not ask for it exclusive (``shared_here``); a thread holding it exclusive is
inside an export, where compiled functions the target calls are traced through (``exclusive_here``).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator


class SharedExclusive:
    """A readers-writer lock that prefers the writer (the export)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._exclusive = False
        self._waiting = 0  # exports waiting for their turn
        self._mine = threading.local()  # this thread's holds: count (shared), exporting (exclusive)
        self._parked: set[int] = set()  # threads waiting to hold it shared

    def shared_here(self) -> bool:
        """Whether this thread holds it shared already."""
        return getattr(self._mine, "count", 0) > 0

    def exclusive_here(self) -> bool:
        """Whether this thread holds it exclusive (it is exporting)."""
        return getattr(self._mine, "exporting", False)

    def parked(self, thread: int) -> bool:
        """Whether ``thread`` waits to hold it shared: it runs nothing of a target until the
        export that holds it ends (an export does not wait for such a thread to leave its model)."""
        return thread in self._parked

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the target with others (an eager call)."""
        with self._cond:
            if not self.shared_here() and not self.exclusive_here():
                me = threading.get_ident()
                self._parked.add(me)
                try:
                    self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
                finally:
                    self._parked.discard(me)
            self._sharing += 1
            self._mine.count = getattr(self._mine, "count", 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._sharing -= 1
                self._mine.count -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the target alone (an export)."""
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._sharing)
            self._waiting -= 1
            self._exclusive = True
        self._mine.exporting = True
        try:
            yield
        finally:
            self._mine.exporting = False
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def renew_in_child(self) -> None:
        """In a forked child only the forking thread is left: the others' holds (an export in
        another thread: eager calls there waited for it for ever) and its lock went with them."""
        self._cond = threading.Condition()
        self._sharing = getattr(self._mine, "count", 0)
        self._exclusive = self.exclusive_here()
        self._waiting = 0
        self._parked = set()


TARGETS = SharedExclusive()
os.register_at_fork(after_in_child=TARGETS.renew_in_child)
