"""The miss path: decide under the lock, run the eager target and captures outside it, swap tables.

The eager target never runs while the lock is held, so calls in Fallback (or after
``take_graph()``) run fully concurrently and a capture in progress for one key does not block
hits on others. A key being captured is marked in flight: another thread missing the same key
serves eagerly meanwhile instead of capturing it twice. ``reset()`` starts a new generation; a
capture that finishes for an older generation is dropped, never installed.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

import serving
from clika_runtime import capture as capture_mod
from clika_runtime import hints, trees
from clika_runtime.calls import CallForms
from clika_runtime.config import config
from clika_runtime.errors import CaptureError, SignatureValueError
from clika_runtime.hits import RunFailed
from clika_runtime.key import CallKey, Unkeyable
from clika_runtime.sharing import TARGETS
from clika_runtime.planning import (
    Call, CapturePlan, Decision, Eager, GiveUp, Options, Serve, Verify, decide, learned, learned_static, over_budget,
    unlifted, variant_static,
)
from clika_runtime.table import CacheTable, State, fallen_back, fresh, rewatched, with_capture, with_replaced, without
from clika_runtime.verify import first_mismatch
from clika_runtime.weights import watch_registrations

logger = logging.getLogger("clika_runtime")
_Tensor = torch.Tensor


@dataclass
class _Attempt:
    """A capture that succeeded after retries: the plan that worked and what the retries gave up."""

    capture: capture_mod.Capture
    plan: CapturePlan
    notes: list[str]
    static_axes: list[tuple[str, int]]
    unliftable: frozenset[int]


class Lifecycle:
    """The mutable heart of one ``CompiledFunction``: its current table and the miss path."""

    def __init__(
        self, *, target: Callable[..., Any], owner: torch.nn.Module | None, forms: CallForms, options: Options,
        fullgraph: bool, optimize: bool, place: serving.Place | None, output_names: tuple[str, ...] | None,
        graph_name: str, name: str, lock: threading.RLock,
    ) -> None:
        self.target, self.owner, self.forms, self.options = target, owner, forms, options
        self.fullgraph, self.optimize, self.place = fullgraph, optimize, place
        self.output_names, self.graph_name, self.name, self.lock = output_names, graph_name, name, lock
        self.table: CacheTable = fresh(0)
        self._inflight: set[tuple[int, CallKey]] = set()
        self._warned: set[str] = set()

    def swap(self, table: CacheTable) -> None:
        """Install a new table (the caller holds the lock)."""
        self.table = table

    def reset(self) -> None:
        """A fresh table of a new generation: captures still in progress will not be installed."""
        with self.lock:
            self.table = fresh(self.table.generation + 1)

    # ---------------------------------------------------------------------------------- the miss

    def miss(self, args: tuple, kwargs: dict) -> Any:
        """Serve a call no hit served: plan under the lock, act outside it."""
        if TARGETS.exclusive_here():  # called inside an export in this thread: be traced through
            return self.target(*args, **kwargs)
        with self.lock:
            decision, call, generation = self._decide(args, kwargs)
        if isinstance(decision, Serve):
            return self._serve(decision.capture, call, args, kwargs)
        if isinstance(decision, Eager):
            return self.eager(args, kwargs)
        if isinstance(decision, GiveUp):
            return self._give_up(decision.why, generation, lambda: self.eager(args, kwargs))
        plan = decision.otherwise if isinstance(decision, Verify) else decision
        token = (generation, plan.call.key)
        try:
            if isinstance(decision, Verify):
                return self._verify(decision, args, kwargs, generation)
            return self._capture(decision, args, kwargs, generation)
        finally:
            with self.lock:
                self._inflight.discard(token)

    def eager(self, args: tuple, kwargs: dict) -> Any:
        """The target's own result for the call as made (never under the function's lock)."""
        with TARGETS.shared():
            return self.target(*args, **kwargs)

    def run_failed(self, failed: RunFailed, args: tuple, kwargs: dict) -> Any:
        """A graph failed on inputs its guard accepted: drop it, serve this call as a miss."""
        if TARGETS.exclusive_here():  # fake tensors of an export in this thread, not a failure
            return self.target(*args, **kwargs)
        with self.lock:
            why = f"the graph failed on these inputs ({hints.first_line(failed.error)}); re-captured from them"
            self.table = without(self.table, [failed.capture], pending=why)
        return self.miss(args, kwargs)

    def _decide(self, args: tuple, kwargs: dict) -> tuple[Decision, Call | None, int]:
        table = self.table
        if table.state is State.Fallback:
            return Eager(), None, table.generation
        trees.sync_registry()  # node types registered since the last miss flatten from now on
        table = self._weights_checked(table)
        try:
            call = Call(self.forms, args, kwargs, self.owner, table.knowledge, self.options)
        except Unkeyable as e:
            self._unkeyable(str(e))
            return Eager(), None, table.generation
        decision = decide(table, call, self.options, self.owner)
        if isinstance(decision, (CapturePlan, Verify)) and TARGETS.shared_here():
            return Eager(), call, table.generation  # the target calls its own compiled function
        if isinstance(decision, (CapturePlan, Verify)):
            plan = decision.otherwise if isinstance(decision, Verify) else decision
            token = (table.generation, plan.call.key)
            if token in self._inflight:  # another thread is capturing this key: serve eagerly meanwhile
                return Eager(), call, table.generation
            self._inflight.add(token)
        return decision, call, table.generation

    def _weights_checked(self, table: CacheTable) -> CacheTable:
        """The table without captures whose baked tensors changed (the next capture says which)."""
        if not table.captures or table.watch.fresh():
            return table
        changed = [b for b in table.watch.baked if b.changed()]
        if not changed:  # a registration elsewhere: nothing baked moved
            self.table = rewatched(table)
            return self.table
        moved = {id(b.tensor) for b in changed}
        stale = [c for c in table.captures if any(id(b.tensor) in moved for b in c.baked)]
        names = ", ".join(f"'{b.name}'" for b in changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        self.table = without(table, stale, pending=f"weights changed: {names}")
        return self.table

    def _serve(self, capture: capture_mod.Capture, call: Call, args: tuple, kwargs: dict) -> Any:
        try:
            return capture.run(call.feeds)
        except Exception as error:
            return self.run_failed(RunFailed(capture, error), args, kwargs)

    # ------------------------------------------------------------------------------ capturing

    def _capture(self, plan: CapturePlan, args: tuple, kwargs: dict, generation: int, out: Any = None,
                 eager_done: bool = False) -> Any:
        if not eager_done:
            out, mutated = self._eager(plan.call, args, kwargs)
            if mutated:
                why = f"input mutation: the call modified input(s) {mutated} in place, which a graph cannot reproduce"
                return self._give_up(why, generation, lambda: out)
        self._check_output_axes(out, plan.call)
        try:
            attempt = self._build(plan, out)
        except CaptureError as error:
            return self._give_up(f"capture failed: {error}", generation, lambda: out, cause=error)
        with self.lock:
            self._install(attempt, generation)
        return out

    def _build(self, plan: CapturePlan, out: Any) -> _Attempt:
        """Build, retrying with less asked of the exporter: numbers baked, then (for a variant) its
        own axes static, or (for drifted axes) the learned axes static for the function. The last
        error is raised."""
        watch_registrations()
        notes: list[str] = []
        static_axes: list[tuple[str, int]] = []
        unliftable: frozenset[int] = frozenset()
        while True:
            try:
                return _Attempt(self._build_once(plan, out), plan, notes, static_axes, unliftable)
            except CaptureError as error:
                step = unlifted(plan, self.owner)
                if step is not None:
                    unliftable = unliftable | plan.call.lifted
                    plan, names = step
                    notes.append(f"numbers {names} stay baked: the exporter could not lift them ({hints.first_line(error)})")
                    continue
                if plan.variant:
                    retry = variant_static(plan)
                    if retry is None:
                        raise
                    notes.append(f"a variant exported static ({hints.first_line(error)})")
                    plan = retry
                    continue
                given_up = learned_static(plan)
                if given_up is None:
                    raise
                plan, axes = given_up
                static_axes += axes
                notes.append(f"axes {axes} could not be exported dynamic ({hints.first_line(error)}); captured them static")

    def _build_once(self, plan: CapturePlan, out: Any) -> capture_mod.Capture:
        inputs = set(plan.call.names)
        return capture_mod.build(
            plan, out, target=self.target, forms=self.forms, owner=self.owner, output_names=self.output_names,
            output_axes={n: dict(a) for n, a in self.options.dynamic_axes.items() if n not in inputs},
            graph_name=self.graph_name, optimize=self.optimize, place=self._place_for(plan.call.feeds),
            parameters=self.forms.positional, exporting=TARGETS.exclusive,
        )

    def _install(self, attempt: _Attempt, generation: int) -> None:
        """Swap in the table with the new capture (the caller holds the lock)."""
        table, plan, capture = self.table, attempt.plan, attempt.capture
        if table.generation != generation or table.state is State.Fallback:
            return  # reset() or a failure elsewhere since this capture began: it serves nothing
        knowledge = learned(table.knowledge, plan, self.options, static_axes=attempt.static_axes,
                            unliftable=attempt.unliftable)
        superseded = [c for c in plan.replaces if capture.guard.check(c.example) is None]
        for note in attempt.notes:
            logger.info("capture of %s: %s", self.name, note)
        if plan.reason is not None:
            logger.info("re-capture of %s: %s", self.name, plan.reason)
        self.table = with_capture(table, capture, reason=plan.reason, replaces=superseded, knowledge=knowledge,
                                  notes=attempt.notes, limit=config.cache_size)

    # ------------------------------------------------------------------------------ verifying

    def _verify(self, decision: Verify, args: tuple, kwargs: dict, generation: int) -> Any:
        """Sizes the graph was not traced for: keep it for them if it agrees with eager there."""
        plan, capture = decision.otherwise, decision.capture
        out, mutated = self._eager(plan.call, args, kwargs)
        if mutated:
            why = f"input mutation: the call modified input(s) {mutated} in place, which a graph cannot reproduce"
            return self._give_up(why, generation, lambda: out)
        feeds = plan.call.feeds
        try:
            served = trees.flatten(capture.run(feeds))[0]
            eager = trees.flatten(out)[0]
            problem = first_mismatch(trees.output_names(out, eager), eager, served)
        except Exception as error:  # onnxruntime refuses the graph at these sizes
            problem = hints.first_line(error)
        with self.lock:
            table = self.table
            if problem is None:
                if table.generation == generation and capture in table.captures:
                    self.table = with_replaced(table, capture, capture.verified_at(feeds))
                return out
            why = over_budget(table, plan, self.options)
        if why is not None:
            return self._give_up(why, generation, lambda: out)
        plan = CapturePlan(plan.call, plan.dynamic, plan.declared,
                           f"{plan.reason}; the graph disagrees with eager there ({problem})", variant=True,
                           untied=plan.untied)
        return self._capture(plan, args, kwargs, generation, out, eager_done=True)

    # -------------------------------------------------------------------------------- helpers

    def _eager(self, call: Call, args: tuple, kwargs: dict) -> tuple[Any, list[str]]:
        """The target's result for the call as made, and the inputs it mutated in place."""
        snapshots = [_snapshot(t) if isinstance(t, _Tensor) else None for t in call.feeds]
        out = self.eager(args, kwargs)  # the target's own exceptions reach the caller unchanged
        mutated = [n for n, t, s in zip(call.names, call.feeds, snapshots) if s is not None and _mutated(t, s)]
        return out, mutated

    def _give_up(self, why: str, generation: int, result: Callable[[], Any], cause: Exception | None = None) -> Any:
        """Fallback to eager with a warning that says why; ``fullgraph=True`` raises instead."""
        if self.fullgraph:
            raise CaptureError(f"{self.name}: {why}") from None
        with self.lock:
            if self.table.generation == generation and self.table.state is not State.Fallback:
                self.table = fallen_back(self.table, why)
                logger.info("%s serves eagerly until reset(): %s", self.name, why)
                warnings.warn(f"clika_runtime: {self.name} serves eagerly until reset(): {why}", stacklevel=_user_level())
        return result()

    def _unkeyable(self, why: str) -> None:
        if self.fullgraph:
            raise CaptureError(f"{self.name}: {why}; pass it as a tensor or a hashable value")
        if why not in self._warned:
            self._warned.add(why)
            logger.info("%s: %s; serving such calls eagerly", self.name, why)
            warnings.warn(f"clika_runtime: {self.name}: {why}; serving this call eagerly", stacklevel=_user_level())

    def _check_output_axes(self, out: Any, call: Call) -> None:
        """``dynamic_axes`` names that are neither inputs nor outputs: an error listing both."""
        unknown = set(self.options.dynamic_axes) - set(call.names)
        if not unknown:
            return
        leaves = trees.flatten(out)[0]
        outputs = self.output_names or trees.output_names(out, leaves)
        unknown -= set(outputs)
        if unknown:
            raise SignatureValueError(
                f"dynamic_axes: {sorted(unknown)} match no input or output; inputs: {list(call.names)}, "
                f"outputs: {list(outputs)}"
            )

    def _place_for(self, feeds: Any) -> serving.Place:
        place = self.place
        if place is None:
            cuda = next((t.device for t in feeds if isinstance(t, _Tensor) and t.device.type == "cuda"), None)
            place = serving.resolve(str(cuda) if cuda is not None and serving.cuda_available() else "cpu")
        return serving.with_torch_stream(place)


def _user_level() -> int:
    """The ``stacklevel`` that points a warning at the user's call, past our own frames."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("clika_runtime"):
        frame, level = frame.f_back, level + 1
    return level


def _snapshot(t: torch.Tensor) -> Any:
    """What to compare after the eager call to tell whether it mutated ``t`` in place."""
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: compare their bytes instead
        return t.detach().clone()


def _mutated(t: torch.Tensor, snapshot: Any) -> bool:
    if isinstance(snapshot, int):
        return t._version != snapshot
    return t.shape != snapshot.shape or not torch.equal(_bytes(t), _bytes(snapshot))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Bytes, not values: NaN != NaN would read as a mutation.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
