"""Build a capture, asking less of the exporter after each failure (the degrade ladder).

1. Python numbers lifted to graph inputs are baked again (and remembered as unliftable).
2. A variant (a branch side, sizes the dynamic graph did not handle) is exported with only the
   user's declared axes dynamic, for itself alone.
3. Otherwise the axes that drift made dynamic are exported static, and the function keeps them
   static from then on (declared axes are always asked).

Each step is noted (``f.capture_notes``); when no step is left, the last error is raised.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from clika_runtime.base.config import config
from clika_runtime.base.errors import (
    CaptureError, SecondSizeError, SignatureValueError, UncapturableError, first_line,
)
from clika_runtime.base.sharing import TARGETS
from clika_runtime.cache import restore
from clika_runtime.capture import capture as capture_mod
from clika_runtime.capture.plan import CapturePlan
from clika_runtime.capture.target import Target
from clika_runtime.capture.value import Capture
from clika_runtime.function.planning import declared_static, learned_static, unlifted, variant_static
from clika_runtime.guards.guard import SPECIAL_BELOW
from clika_runtime.state.weights import watch_registrations
from clika_runtime.trees import pytrees as trees

logger = logging.getLogger("clika_runtime")
PROGRESS_AFTER = 2.0  # seconds a capture runs before it says what it is doing


@dataclass
class Attempt:
    """A capture that succeeded, the plan that made it, and what the retries gave up on the way
    (``said``: those of its notes the user is warned of, not only told in ``capture_notes``)."""

    capture: Capture
    plan: CapturePlan
    notes: list[str]
    static_axes: list[tuple[str, int]]
    unliftable: frozenset[int]
    said: list[str] = field(default_factory=list)
    restored: bool = False  # found in the disk cache, not exported


def build(target: Target, plan: CapturePlan, out: Any, ahead: restore.Ahead | None = None,
          elsewhere: bool = False, on_trace: Callable[[], None] | None = None) -> Attempt:
    """Capture ``plan`` (its call's eager result is ``out``): from the disk cache when an earlier
    process made it, else by exporting, degrading until it succeeds (then kept in the cache).
    ``ahead``: the cache lookup started before the eager call; ``elsewhere``: a dynamic graph is
    verified at a second size too (``capture.second_size``; a graph that fails it is exported
    with those axes static); ``on_trace``: called each time an export has run the target's Python
    (``capture.build``). Raises the last ``CaptureError`` when nothing is left to give up."""
    check_output_axes(target, out, plan)
    watch_registrations()
    with _progress(target, plan) as attempt_of:
        attempt = _cached_or_exported(target, plan, out, ahead, elsewhere, on_trace)
        attempt_of.append(attempt)
    return attempt


@contextlib.contextmanager
def _progress(target: Target, plan: CapturePlan) -> Iterator[list[Attempt]]:
    """Say what a capture is doing when it takes longer than ``PROGRESS_AFTER`` seconds (big models
    take minutes): on the logger, and on stderr as one line that counts the seconds, the way
    tqdm-style tools do (``config.progress``); and how long each phase took when it is done."""
    shapes = ", ".join(f"{n}[{','.join(map(str, v.shape))}]" if hasattr(v, "shape") else f"{n}={v}"
                       for n, v in zip(plan.call.names, plan.call.feeds))
    what = f"{target.graph_name}({shapes})"
    line = _Line(config.shows_progress())
    stop, started, done = threading.Event(), time.perf_counter(), []

    def tick() -> None:
        if stop.wait(PROGRESS_AFTER):
            return
        logger.info("capturing %s ...", what)
        while not stop.is_set():
            line.show(f"clika_runtime: capturing {what} ... {time.perf_counter() - started:.0f} s")
            stop.wait(1.0)

    ticker = threading.Thread(target=tick, name="clika_runtime progress", daemon=True)
    ticker.start()
    try:
        yield done
    finally:
        stop.set()
        ticker.join()
        took = time.perf_counter() - started
        if done and took > PROGRESS_AFTER:
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in done[0].capture.stats.phases.items())
            logger.info("captured %s in %.1f s: %s", what, took, phases)
            line.show(f"clika_runtime: captured {what} in {took:.1f} s ({phases})", last=True)
        else:
            line.show("", last=True)


class _Line:
    """One line on stderr, rewritten in place (a carriage return), ended when the capture ends."""

    def __init__(self, on: bool) -> None:
        self.on, self.width = on, 0

    def show(self, text: str, last: bool = False) -> None:
        if not self.on or (not text and not self.width):
            return
        padded = text.ljust(self.width)
        self.width = len(text)
        try:
            sys.stderr.write("\r" + padded + ("\n" if last and text else "\r" if last else ""))
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed or broken stderr: the logger still says it
            self.on = False


def _cached_or_exported(target: Target, plan: CapturePlan, out: Any, ahead: restore.Ahead | None,
                        elsewhere: bool, on_trace: Callable[[], None] | None) -> Attempt:
    ready = ahead.ready() if ahead is not None and ahead.plan is plan else None  # the plan the lookup was for
    slot = ready.slot if ready is not None else restore.slot_for(target, plan)
    if slot is not None:
        found = restore.restore(slot, target, plan, out, ready)
        if found is not None:
            capture, used, meta = found
            return Attempt(capture, used, list(meta["notes"]), [tuple(a) for a in meta["static_axes"]],
                           frozenset(meta["unliftable"]), restored=True)
    work = slot.cache.ready() if slot is not None else None
    try:
        attempt = _exported(target, plan, out, work, elsewhere, on_trace)
    except CaptureError as error:
        if work is None or not isinstance(error.__cause__, OSError):
            raise
        # The cache's filesystem failed the graph's files (read-only, full): off, and the capture
        # made in the system's temporary folder instead.
        slot.cache.refuse(error.__cause__)
        slot, attempt = None, _exported(target, plan, out, None, elsewhere, on_trace)
    if attempt.capture.precision_note:  # kept with the entry: a restore serves the same fp32 graph
        attempt.notes.append(attempt.capture.precision_note)
    if slot is not None:
        restore.store(slot, attempt.capture, attempt.plan, attempt.notes, attempt.static_axes, attempt.unliftable,
                      target.graph_name)
    return attempt


def _exported(target: Target, plan: CapturePlan, out: Any, work_dir: Any, elsewhere: bool,
              on_trace: Callable[[], None] | None) -> Attempt:
    """The degrade ladder over fresh exports."""
    notes = _specialised(target, plan)
    said: list[str] = []  # notes the user is warned of too
    static_axes: list[tuple[str, int]] = []
    unliftable: frozenset[int] = frozenset()
    while True:
        try:
            capture = _build_once(target, plan, out, work_dir, elsewhere, on_trace)
            return Attempt(capture, plan, notes + said, static_axes, unliftable, said)
        except UncapturableError:
            raise
        except CaptureError as error:
            if isinstance(error.__cause__, OSError):  # files that could not be written: no other export helps
                raise
            why = first_line(error)
            step = unlifted(plan, target.owner)
            if step is not None:
                unliftable = unliftable | plan.call.lifted
                plan, names = step
                notes.append(f"numbers {names} stay baked: the exporter could not lift them ({why})")
                continue
            if plan.variant:
                retry = variant_static(plan)
                if retry is not None:
                    notes.append(f"a variant exported static ({why})")
                    plan = retry
                    continue
            else:
                given_up = learned_static(plan)
                if given_up is not None:
                    plan, axes = given_up
                    static_axes += axes
                    notes.append(f"axes {axes} could not be exported dynamic ({why}); captured them static")
                    continue
            declared = declared_static(plan) if isinstance(error, SecondSizeError) else None
            if declared is None:
                raise
            plan, axes = declared
            static_axes += axes
            said.append(f"axes {axes} were declared dynamic, but their graph disagrees with eager at other sizes "
                        f"({why}): captured static, a graph per size")


def _specialised(target: Target, plan: CapturePlan) -> list[str]:
    """With ``dynamic=True``, a note per axis the plan left static because its size in the call is
    0 or 1 (``CapturePlan``): the user asked for every axis dynamic and would not know otherwise.
    None for a variant: sizes 0 and 1 beside a dynamic graph get a graph of their own by design."""
    if target.options.dynamic is not True or plan.variant:
        return []
    return [
        f"axis {axis} of '{name}' has size {size} in the example: torch.export specialises sizes 0 and 1, so it was "
        f"captured static; capture with a size >= {SPECIAL_BELOW} on that axis to make it dynamic (or declare it: "
        f"dynamic_axes, a named signature dim)"
        for name, value, axes in zip(plan.call.names, plan.call.feeds, plan.dynamic) if isinstance(value, torch.Tensor)
        for axis, size in enumerate(value.shape) if size < SPECIAL_BELOW and axis not in axes
    ]


def _build_once(target: Target, plan: CapturePlan, out: Any, work_dir: Any, elsewhere: bool,
                on_trace: Callable[[], None] | None) -> Capture:
    inputs = set(plan.call.names)
    return capture_mod.build(
        plan, out, target=target.fn, forms=target.forms, owner=target.owner, output_names=target.output_names,
        output_axes={n: dict(a) for n, a in target.options.dynamic_axes.items() if n not in inputs},
        graph_name=target.graph_name, optimize=target.optimize, place=target.place_for(plan.call.feeds),
        parameters=target.forms.positional, exporting=TARGETS.exclusive, parked=TARGETS.parked, work_dir=work_dir,
        precision=target.precision, agreement=target.agreement_now(), elsewhere=elsewhere, on_trace=on_trace,
    )


def check_output_axes(target: Target, out: Any, plan: CapturePlan) -> None:
    """``dynamic_axes`` names that are neither inputs nor outputs: an error listing both."""
    unknown = set(target.options.dynamic_axes) - set(plan.call.names)
    if not unknown:
        return
    leaves = trees.flatten(out)[0]
    outputs = target.output_names or trees.output_names(out, leaves)
    unknown -= set(outputs)
    if unknown:
        raise SignatureValueError(
            f"dynamic_axes: {sorted(unknown)} match no input or output; inputs: {list(plan.call.names)}, "
            f"outputs: {list(outputs)}"
        )
