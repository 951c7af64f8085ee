"""Other threads' uses of a model while it is exported.

torch.export swaps the traced model's parameters and buffers for fake tensors on the model
object itself, puts its attributes back as they were when it ends, and torch.fx patches
``nn.Module.__call__`` for the whole process: another thread meanwhile computed with fakes (a
FakeTensor returned, an AssertionError from fake mode), read fakes (a monitor's weight norms, a
checkpoint saver's ``state_dict()``), had its attribute writes undone, or broke the export.
``held`` keeps such uses out of the export's span: the export starts once the calls of its
model's modules already running in other threads have ended, and other threads' calls, attribute
reads and writes, and walks of its tensors (``state_dict``, ``parameters()``, ``.to()``) wait
for it to end.

A fork waits for the exports in progress to end (``_before_fork``): a child forked during one
would find the model's tensors swapped for the trace's fakes and its modules' methods waiting for
an export thread it does not have (a plain ``model(x)`` there waited, then raised). Where the
wait ends first (an export past ``FORK_WAITS``), the child puts the methods back.

A call from another thread that is given the trace's own tensors is the traced function's work
done on a thread pool: a trace follows one thread, so that call raises ``InOtherThread`` (the
export fails saying why) instead of waiting for an export that waits for it. A use that has
waited ``STUCK_AFTER`` seconds for an export whose thread has not moved raises it too: that thread
may wait for something the waiting one holds (a lock both take), and neither would ever go on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

# How long an export waits for uses already running in other threads to end. One still running
# then may itself wait on the export's thread (a compiled function it calls): the export goes
# ahead, and that use sees fakes only if it reads a tensor it already holds (not through the module).
DRAIN_FOR = 10.0
_POLL = 0.002
# How long a use waits for an export whose thread has not moved (the same innermost frame at the
# same instruction) before it raises: that thread may wait for something the waiting one holds (a
# lock both take). A single step of an export that takes this long is not expected.
STUCK_AFTER = 30.0
_LOOK_EVERY = 0.25


# How long a fork waits for the exports in progress in other threads to end.
FORK_WAITS = 120.0


class InOtherThread(RuntimeError):
    """A module of the traced model was used from another thread with the trace's tensors, or
    waited for an export that does not move."""


# The ways another thread reaches a module's tensors: its calls, its attributes (parameters,
# buffers and submodules are read through ``__getattr__``), its walks over them.
_GATED = ("__call__", "__getattr__", "__setattr__", "state_dict", "load_state_dict", "_named_members", "_apply")


@contextlib.contextmanager
def held(traced: torch.nn.Module, parked: Callable[[int], bool] | None = None) -> Iterator[None]:
    """While the block runs, other threads' uses of ``traced``'s modules wait for it to end, and
    it starts once the uses of them already running have ended (see the module's doc), but in
    threads ``parked`` says wait on this one (they use nothing of the model meanwhile)."""
    gate = _Gate(frozenset(id(m) for m in traced.modules()), threading.get_ident(), parked or _nobody)
    originals = {name: getattr(torch.nn.Module, name) for name in _GATED}
    gates = {name: gate.wrap(method) for name, method in originals.items()}
    for name, gated in gates.items():
        setattr(torch.nn.Module, name, gated)
    _EXPORTING[gate] = (originals, gates)
    try:
        gate.drain(_codes(originals.values()))
        yield
    finally:
        _lifted(gate, originals, gates)
        _EXPORTING.pop(gate, None)


_EXPORTING: dict["_Gate", tuple[dict, dict]] = {}  # the exports in progress: their methods, as held put them


def _lifted(gate: "_Gate", originals: dict, gates: dict) -> None:
    for name, gated in gates.items():
        if getattr(torch.nn.Module, name) is gated:  # not replaced by someone else since
            setattr(torch.nn.Module, name, originals[name])
    gate.open()


def _before_fork() -> None:
    deadline, here = time.monotonic() + FORK_WAITS, threading.get_ident()
    for gate in list(_EXPORTING):
        if gate.here != here:  # a fork from the traced code itself cannot wait for its own export
            gate.done.wait(max(0.0, deadline - time.monotonic()))


def _in_child() -> None:
    for gate, (originals, gates) in list(_EXPORTING.items()):  # its thread is not in the child
        _lifted(gate, originals, gates)
    _EXPORTING.clear()


os.register_at_fork(before=_before_fork, after_in_child=_in_child)


class _Gate:
    """The wait every gated method does, for one export (made in ``held``)."""

    def __init__(self, mine: frozenset[int], here: int, parked: Callable[[int], bool]) -> None:
        self.mine, self.here, self.parked = mine, here, parked
        self.codes: frozenset[Any] = frozenset()  # the methods' code: a frame of one is a use in progress
        self.draining = True
        self.done = threading.Event()

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def gated(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if id(module) in self.mine and not self.done.is_set() and threading.get_ident() != self.here:
                self.wait(module, args, kwargs)
            return method(module, *args, **kwargs)

        return gated

    def wait(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if _traced_tensor(args, kwargs):
            raise InOtherThread(
                f"a module of the traced model ({type(module).__name__}) was used from another thread with the "
                "trace's tensors (a forward that runs its modules on a thread pool?): a trace follows one thread, "
                "so this function cannot be exported")
        if self.draining and _inside(sys._getframe(), self.mine, self.codes):
            return  # a use running since before the export: it ends first
        where, since = _position(self.here), time.monotonic()
        while not self.done.wait(_LOOK_EVERY):
            now = _position(self.here)
            if now != where:
                where, since = now, time.monotonic()
            elif time.monotonic() - since > STUCK_AFTER:
                raise InOtherThread(
                    f"this thread waited {STUCK_AFTER:.0f} s to use {type(module).__name__} for an export of its model "
                    "in another thread, which has not moved since: it may wait for something this thread holds (a "
                    "lock taken by both); raising here lets it go on")

    def drain(self, codes: frozenset[Any]) -> None:
        self.codes = codes
        deadline = time.monotonic() + DRAIN_FOR
        while time.monotonic() < deadline and _running_elsewhere(self.mine, self.here, codes, self.parked):
            time.sleep(_POLL)
        self.draining = False

    def open(self) -> None:
        self.done.set()


def _codes(methods: Any) -> frozenset[Any]:
    """The code of ``methods`` and of the module call's inner half (``_call_impl``)."""
    functions = [*methods, getattr(torch.nn.Module, "_call_impl", None)]
    return frozenset(f.__code__ for f in functions if hasattr(f, "__code__"))


def _inside(frame: Any, mine: frozenset[int], codes: frozenset[Any]) -> bool:
    """Whether a frame, or one it was called from, is a use of one of the modules in ``mine``."""
    while frame is not None:
        if frame.f_code in codes and id(frame.f_locals.get("self")) in mine:
            return True
        frame = frame.f_back
    return False


def _running_elsewhere(mine: frozenset[int], here: int, codes: frozenset[Any], parked: Callable[[int], bool]) -> bool:
    return any(_inside(frame, mine, codes) for thread, frame in sys._current_frames().items()
               if thread != here and not parked(thread))


def _position(thread: int) -> tuple[int, int] | None:
    """Where ``thread`` is: its innermost frame and instruction (``None``: it has ended)."""
    frame = sys._current_frames().get(thread)
    return None if frame is None else (id(frame), frame.f_lasti)


def _nobody(thread: int) -> bool:
    return False


def _traced_tensor(args: tuple, kwargs: dict) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(leaf, FakeTensor) for leaf in torch.utils._pytree.tree_leaves((args, kwargs)))
