"""How a function says it serves eagerly, and records it: a key refused (its capture failed), the
whole function in Fallback (the budget), a call that cannot be keyed, a bug of the library's own;
and a capture that serves at fp32 though a reduced precision was asked for.
Each is said once, as a warning pointed at the user's call, and on the ``clika_runtime`` logger;
``fullgraph=True`` raises ``CaptureError`` instead.

``Fallbacks`` is the part of ``Lifecycle`` that does it (it reads and swaps the same table under
the same lock); the messages shared with the miss path are the functions below it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from exporters import DECLINES

from clika_runtime.base.errors import CaptureError, ClikaError, first_line
from clika_runtime.base.precision import FP32
from clika_runtime.base.saying import raise_held, say
from clika_runtime.base.sharing import TARGETS
from clika_runtime.capture.closures import RunFailed
from clika_runtime.capture.envelope import Eagerly
from clika_runtime.capture.plan import Call
from clika_runtime.capture.target import Target, target_raised
from clika_runtime.capture.value import Capture
from clika_runtime.function import staleness
from clika_runtime.function.table import CacheTable, State, fallen_back, noted, swapped, unmade, with_refused, without
from clika_runtime.state import weights
from clika_runtime.state.snapshot import plain_call

logger = logging.getLogger("clika_runtime")


class Fallbacks:
    """Serving eagerly, said once: what ``Lifecycle`` does when a call will not be served by a graph."""

    target: Target
    lock: threading.RLock
    table: CacheTable
    _warned: set[str]

    def _miss(self, args: tuple, kwargs: dict, progress: "Progress") -> Any:
        raise NotImplementedError  # Lifecycle's: the miss itself

    def miss(self, args: tuple, kwargs: dict) -> Any:
        """Serve a call no hit served: plan under the lock, act outside it. The target's own
        exceptions reach the caller unchanged; one of the library's own ends in the eager result
        (``internal_error``), and the target never runs twice for one call."""
        if TARGETS.exclusive_here():  # called inside an export in this thread: be traced through
            return self.target.fn(*args, **kwargs)
        if not plain_call():  # autocast, a mode, a trace, a transform: theirs, untouched (no lookup, no capture)
            return self.target.eager(args, kwargs)
        progress = Progress()
        try:
            out = self._miss(args, kwargs, progress)
        except Exception as error:
            if target_raised(error) or isinstance(error, ClikaError):  # a signature error, fullgraph's refusal
                raise
            doing = "capturing this call" if progress.ran else "planning this call"
            result = (lambda: progress.out) if progress.ran else (lambda: self.target.eager(args, kwargs))
            return self.internal_error(error, doing, result, progress.call)
        raise_held()  # a warning the caller made an error (-W error), said on the way
        return out

    def internal_error(self, error: Exception, doing: str, result: Callable[[], Any], call: Call | None = None) -> Any:
        """An exception of the library's own code (a bug): the call is served eagerly, with a
        warning that names what failed, once; its key (when known) serves eagerly from now on.
        ``fullgraph=True`` raises ``CaptureError`` with the cause chained."""
        name = self.target.name
        where = innermost(error)
        why = (f"clika_runtime failed {doing} ({type(error).__name__}: {first_line(error)}, in {where}); "
               "this is a bug in clika_runtime: please report it with this message")
        if self.target.fullgraph:
            raise CaptureError(f"{name}: {why}") from error
        logger.debug("%s: %s", name, why, exc_info=error)
        if call is not None:
            with self.lock:
                self.table = with_refused(self.table, call.key, call.described.words(), why)
        self._say_once(f"{why}; served eagerly")
        out = result()
        raise_held()
        return out

    def run_failed(self, failed: RunFailed, args: tuple, kwargs: dict) -> Any:
        """A graph failed on inputs its guard accepted: serve this call as a miss. At sizes other
        than its own, the graph keeps serving the sizes on its side of them, verified there, and
        the miss traces a variant beside it; at its own sizes (values failed it) it is dropped and
        the miss re-captures from these inputs. When the target raises on them too, the graph is
        kept as it was."""
        if TARGETS.exclusive_here():  # fake tensors of an export in this thread, not a failure
            return self.target.fn(*args, **kwargs)
        if DECLINES in str(failed.error):  # values the graph cannot answer exactly: not its failure
            return self.eagerly(Eagerly(first_line(failed.error)), args, kwargs)
        with self.lock:
            kept = self.table
            narrowed = failed.capture.refusing(failed.feeds)
            if narrowed is not None:
                note = (f"the graph failed at {_shapes(failed.feeds)} ({first_line(failed.error)}): its guard refuses "
                        "those sizes and any past them, which get a graph of their own beside it")
                dropped = self.table = swapped(kept, failed.capture, narrowed, note)
            else:
                why = f"the graph failed on these inputs ({first_line(failed.error)}); re-captured from them"
                dropped = self.table = without(kept, [failed.capture], pending=why, spends=True)
        try:
            return self.miss(args, kwargs)
        except BaseException as error:
            # The target raised on these inputs too (an id past the end): they were bad, not the
            # graph, which serves on (a bad request stream must not re-export it, nor spend the budget).
            with self.lock:
                if target_raised(error) and self.table is dropped:
                    self.table = kept
            raise

    def eagerly(self, eagerly: Eagerly, args: tuple, kwargs: dict) -> Any:
        """A call an int8 graph does not answer (``capture.envelope``): the target's own answer,
        by which the graph's is judged where there is a judge (said once where it falls short)."""
        out = self.target.eager(args, kwargs)
        short = eagerly.judge(out) if eagerly.judge is not None else None
        if short is not None:
            with self.lock:
                self.table = noted(self.table, short)
            self._say_once(short)
        raise_held()
        return out

    def _give_up(self, why: str, generation: int, result: Callable[[], Any]) -> Any:
        """Fallback to eager with a warning that says why; ``fullgraph=True`` raises instead."""
        name = self.target.name
        if self.target.fullgraph:
            raise CaptureError(f"{name}: {why}") from None
        with self.lock:
            if self.table.generation == generation and self.table.state is not State.Fallback:
                self.table = fallen_back(self.table, why)
                logger.info("%s serves eagerly until reset(): %s", name, why)
                say(f"clika_runtime: {name} serves eagerly until reset(): {why}", _user_level())
        return result()

    def _refuse(self, call: Call, why: str, generation: int, result: Callable[[], Any], point: Any = None) -> Any:
        """This call's key serves eagerly until ``reset()``, with a warning that says why; the
        other keys keep capturing (torch.compile falls back per frame). A variant's failure
        (``point``: the sizes it was traced for, beside a graph that serves the key's others)
        refuses those sizes only. ``fullgraph=True`` raises."""
        name = self.target.name
        if self.target.fullgraph:
            raise CaptureError(f"{name}: {why}") from None
        refused = call.key if point is None else (call.key, point)
        with self.lock:
            if self.table.generation == generation and refused not in self.table.refused:
                key = call.described.words()
                at = "" if point is None else \
                    " at " + (", ".join(f"{dim}={size}" for dim, size in point.sizes) or "its sizes")
                self.table = with_refused(self.table, refused, key + at, why,
                                          weights.converted_watch(self.target.owner, self.target.fn))
                logger.info("%s serves eagerly until reset(), for calls with the key %s%s: %s", name, key, at, why)
                others = "calls with other keys still capture" if point is None else "its other sizes are still served"
                said = f"refused {key}{at}: {why}"
                if said not in self._warned:  # once: a key tried again (``converted_watch``) may fail alike each epoch
                    self._warned.add(said)
                    again = _tried_again(self.target)
                    say(f"clika_runtime: {name} serves eagerly until reset(), for calls with the key ({key}){at}: "
                        f"{why}; {others}; tried again once {again}", _user_level())
        return result()

    def _unmade(self, why: str, generation: int, out: Any) -> Any:
        """A capture not made because another thread changed the model while it was made: no key
        is refused, the next call captures again, and the re-capture budget is spent (``unmade``)."""
        with self.lock:
            if self.table.generation == generation:
                self.table = unmade(self.table, why)
        logger.info("%s: %s; the next call captures again", self.target.name, why)
        return out

    def _unkeyable(self, why: str) -> None:
        if self.target.fullgraph:
            raise CaptureError(f"{self.target.name}: {why}; pass it as a tensor or a hashable value")
        with self.lock:
            if None not in self.table.refused:  # what f.state and f.fallback_reason say while nothing serves
                self.table = with_refused(self.table, None, "calls that cannot be keyed",
                                          f"{why}; such calls serve eagerly")
        self._say_once(f"{why}; serving this call eagerly")

    def _said_precision(self, capture: Capture, notes: list[str]) -> None:
        """Say once that a capture serves at fp32 though a reduced precision was asked for, and why."""
        asked = self.target.precision
        if asked != FP32 and capture.precision is None:
            self._say_once(next((n for n in notes if n.startswith(f"{asked} not served")),
                                f"{asked} not served, fp32 serves instead"))

    def _say_once(self, why: str) -> None:
        """Say once (per reason) why calls serve eagerly without capturing, or at a precision
        other than the one asked for. A reason is the same whatever its counts say (``spent by 9
        ...`` after ``spent by 8 ...``: a thread changing weights beside calls said it 80 times)."""
        key = _COUNTS.sub("#", why)
        if key not in self._warned:
            self._warned.add(key)
            logger.info("%s: %s", self.target.name, why)
            say(f"clika_runtime: {self.target.name}: {why}", _user_level())


@dataclass
class Progress:
    """How far one miss got, for its boundary: the call it planned, and the eager result once
    the target ran (an error after that returns it: the target never runs twice for one call)."""

    call: Call | None = None
    ran: bool = False
    out: Any = None


_COUNTS = re.compile(r"\d+")  # the numbers in a reason: counts that move while the reason stands

_OURS = tuple(f"{os.sep}{top}{os.sep}" for top in ("clika_runtime", "exporters", "serving"))


def innermost(error: BaseException) -> str:
    """Where in the library an exception was raised: its innermost frame in our code."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        marks = [m for m in _OURS if m in frame.filename]
        if marks:
            return f"{frame.filename[frame.filename.rindex(marks[0]) + 1:]}:{frame.lineno} {frame.name}"
    return "an unknown place"


def _shapes(feeds: Sequence[Any]) -> str:
    return ", ".join(str(tuple(feed.shape)) for feed in feeds if hasattr(feed, "shape"))


def differentiating(needing: list[str]) -> str:
    return (f"grad mode is on and the weights require grad ({staleness.listed(needing, repr)}): a graph's outputs "
            "cannot carry gradients back, so such calls run eagerly (backward() works as without clika_runtime); serve "
            "inference under torch.inference_mode() or torch.no_grad(), or freeze the weights "
            "(model.requires_grad_(False))")


def mutation(names: list[str]) -> str:
    return f"input mutation: the call modified input(s) {names} in place, which a graph cannot reproduce"


def _user_level() -> int:
    """The ``stacklevel`` that points a warning at the user's call, past our own frames and
    torch's (``nn.Module.__call__`` on the way to a compiled ``forward``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("clika_runtime", "torch.")):
        frame, level = frame.f_back, level + 1
    return level


def _tried_again(target: Target) -> str:
    """When a refused key is tried again (``weights.converted_watch``), in words."""
    if target.owner is not None:
        return "its weights change dtype or device"
    if weights.modules_reached(target.fn, None):
        return "the models it calls change dtype, device or train/eval mode"
    return "the tensors it reads change dtype or device, or the default dtype does"
