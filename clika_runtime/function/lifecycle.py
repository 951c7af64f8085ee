"""The miss path: decide under the lock, run the eager target and captures outside it, swap tables.

The eager target never runs while the lock is held, so calls in Fallback (or after
``take_graph()``) run fully concurrently and a capture in progress for one key does not block
hits on others. A key being captured is marked in flight: another thread missing the same key
serves eagerly meanwhile instead of capturing it twice. ``reset()`` starts a new generation; a
capture that finishes for an older generation is dropped, never installed.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from clika_runtime.base import memory
from clika_runtime.base.config import config
from clika_runtime.base.errors import CaptureError, EmptyKillsError, VerificationError, first_line
from clika_runtime.base.sharing import TARGETS
from clika_runtime.cache import restore
from clika_runtime.capture.closures import RunFailed
from clika_runtime.capture.envelope import Eagerly
from clika_runtime.capture.plan import Call, CapturePlan, Knowledge
from clika_runtime.capture.target import Target
from clika_runtime.capture.value import Capture
from clika_runtime.function import degrade, staleness
from clika_runtime.function.fallbacks import Fallbacks, Progress, differentiating, mutation
from clika_runtime.function.planning import (
    EMPTY, Decision, Eager, GiveUp, Serve, Settle, decide, learned, planned,
)
from clika_runtime.function.table import CacheTable, State, empty, retrying_refused, with_capture, without
from clika_runtime.state import reads, weights
from clika_runtime.state.snapshot import Snapshot, hook_containers
from clika_runtime.state.walk import modes_read
from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.key import CallKey, Unkeyable

logger = logging.getLogger("clika_runtime")


class Lifecycle(Fallbacks):
    """The mutable heart of one ``CompiledFunction``: its current table and the miss path."""

    def __init__(self, target: Target, lock: threading.RLock) -> None:
        self.target, self.lock = target, lock
        self.table: CacheTable = empty(0)
        self._inflight: set[tuple[int, CallKey]] = set()
        _LIVE.add(self)
        self._warned: set[str] = set()
        self._still = weights.Stillness(target.owner, target.fn)  # past a Settle: whether the weights hold still
        self._modes: tuple[int, frozenset[str]] | None = None  # the generation, the modes its code asks about

    def swap(self, table: CacheTable) -> None:
        """Install a new table (the caller holds the lock)."""
        self.table = table

    def reset(self) -> None:
        """A fresh table of a new generation: captures still in progress will not be installed."""
        with self.lock:
            self.table = empty(self.table.generation + 1)
        restore.forget(self.target)  # the weights hashed again: a reset often follows a write no one sees
        memory.give_back()

    # ---------------------------------------------------------------------------------- the miss

    def _miss(self, args: tuple, kwargs: dict, progress: "Progress") -> Any:
        if self.table.last is None and self.table.state is State.Pending:
            self._recall()
        with self.lock:
            decision, call, generation = self._decide(args, kwargs)
        progress.call = call
        if isinstance(decision, Serve):
            return self._serve(decision.capture, call, args, kwargs)
        if isinstance(decision, Eager):
            if decision.why is not None:
                self._say_once(decision.why)
            return self.target.eager(args, kwargs)
        if isinstance(decision, GiveUp):
            return self._give_up(decision.why, generation, lambda: self.target.eager(args, kwargs))
        token = (generation, decision.call.key)
        try:
            return self._capture(decision, args, kwargs, generation, progress)
        finally:
            with self.lock:
                self._inflight.discard(token)

    def _recall(self) -> None:
        """Before a function's first capture: what an earlier process learned about it (read
        outside the lock: disk I/O), so its first capture is planned as the last one was."""
        knowledge = restore.recall(self.target)
        with self.lock:
            table = self.table
            if knowledge is not None and table.last is None and table.state is State.Pending and not table.knowledge.learned:
                self.table = replace(table, knowledge=knowledge)

    def _decide(self, args: tuple, kwargs: dict) -> tuple[Decision, Call | None, int]:
        table = self.table
        if table.state is State.Fallback:
            return Eager(), None, table.generation
        kvcache.register()  # KV-cache classes flatten through their adapter (before torch's registry is mirrored)
        trees.sync_registry((args, kwargs))  # new node types, and this call's containers of tensors
        if (not table.captures or not table.fresh()) and (lent := weights.lent(self.target.owner)):  # before any capture is dropped
            self._say_once(f"the parameters {staleness.listed(lent, repr)} hold plain tensors (torch.func."
                           "functional_call swaps them in for one call): such calls run eagerly, the graphs stay")
            return Eager(), None, table.generation
        if (mode := self._in_a_mode_read(table)) is not None:  # before any capture is dropped
            self._say_once(f"the code asks whether {mode} mode is on, and graphs are traced under no_grad, outside "
                           f"inference mode: calls in {mode} mode run eagerly; call under torch.no_grad() to have "
                           "them served")
            return Eager(), None, table.generation
        table = self.table = staleness.checked(table, self.target)
        if table.refused and table.retried < config.recapture_limit and not table.refused_still():
            table = self.table = retrying_refused(table)  # m.float() after m.double() failed: try again, a few times
        target = self.target
        try:
            call = Call(target.forms, args, kwargs, target.owner, table.knowledge, target.options)
        except Unkeyable as e:
            self._unkeyable(str(e))
            return Eager(), None, table.generation
        if torch.is_grad_enabled() and (needing := weights.needing_grad(target.fn, target.owner)):
            self._say_once(differentiating(needing))
            return Eager(), call, table.generation
        if not table.captures and weights.uninitialized(target.owner):  # this eager call makes them
            return Eager(), call, table.generation
        if held := weights.shared(target.owner, target.fn):  # (served calls: share_memory() moved the weights)
            self._say_once(f"the weights {staleness.listed(held, repr)} are in shared memory (share_memory(), "
                           "torch.multiprocessing): another process can write them unseen here, so calls run eagerly; "
                           "compile a copy (copy.deepcopy(model)) to have them served")
            return Eager(), call, table.generation
        decision = decide(table, call, target.options, target.owner)
        if isinstance(decision, Settle):
            decision = decision.plan if self._still.held() else Eager(decision.why)
        if isinstance(decision, CapturePlan):
            token = (table.generation, decision.call.key)
            if token in self._inflight or TARGETS.shared_here():
                # another thread captures this key, or the target calls its own compiled function
                return Eager(), call, table.generation
            self._inflight.add(token)
        return decision, call, table.generation

    def _in_a_mode_read(self, table: CacheTable) -> str | None:
        """The mode this call is in that the target's code asks about (``MODE_READERS``), if any:
        a graph answers for no_grad outside inference mode only. Read from the captures' snapshot,
        else walked once per ``reset()`` (a training loop's calls in grad mode walked it on each)."""
        on = [mode for mode, is_on in (("grad", torch.is_grad_enabled), ("inference", torch.is_inference_mode_enabled))
              if is_on()]
        if not on:
            return None
        if table.captures:
            read = table.snapshot.modes()
        else:
            if self._modes is None or self._modes[0] != table.generation:
                self._modes = (table.generation, modes_read(self.target.fn, self.target.owner))
            read = self._modes[1]
        return next((mode for mode in on if mode in read), None)

    def _serve(self, capture: Capture, call: Call, args: tuple, kwargs: dict) -> Any:
        try:
            out = capture.run(call.feeds)
        except Eagerly as eagerly:
            return self.eagerly(eagerly, args, kwargs)
        except Exception as error:
            return self.run_failed(RunFailed(capture, error, call.feeds), args, kwargs)
        return out if capture.finish is None else capture.finish(out, *call.canonical)  # a KV cache written back

    # ------------------------------------------------------------------------------ capturing

    def _capture(self, plan: CapturePlan, args: tuple, kwargs: dict, generation: int, progress: "Progress") -> Any:
        """Run ``plan``'s call eagerly and capture it; the eager result is the call's."""
        with TARGETS.shared():
            before = staleness.snapshot(self.target, self.table.written)  # to tell what the target writes itself
            weights_written = weights.written_later(self.target.owner, self.target.fn)
        ahead = restore.ahead(self.target, plan)  # the disk cache looked up beside the eager call
        given = self.target.held(args, kwargs)  # (outside the noting: our code reads no state of theirs)
        with reads.noted() as codes:  # the code the eager run runs: the names it can read
            out, mutated = self.target.eager_checked(plan.call.feeds, plan.call.names, args, kwargs)
        progress.ran, progress.out = True, out
        mutated += given.written(out)
        if mutated:
            return self._refuse(plan.call, mutation(mutated), generation, lambda: out, plan.point)
        with TARGETS.shared():
            # Moved during the eager run: written by the target, or by another thread meanwhile.
            ran = before.moved()
            # The state the trace starts from: a change another thread makes while it runs is a
            # change the next call sees (taken after the trace, it would be baked unseen).
            after = before.refreshed()
            hooked = hook_containers(self.target.owner) if self.target.owner is not None else []
            put_back = before.keeper(ran, [held for _, held in hooked])  # what the trace's writes overwrite
        if _switched(self.target.owner, plan.call):
            return self._unmade(_SWITCHED, generation, out)
        plan = planned(plan, out, self.target.options)  # a decoder step: its sequence axes dynamic
        rewrites = _Rewrites(after)
        try:
            # A second size runs the target once more: not where that writes its state or feeds hooks.
            attempt = degrade.build(self.target, plan, out, ahead, elsewhere=not ran and not _hooks(self.target.owner),
                                    on_trace=rewrites)
        except CaptureError as error:
            meanwhile = _meanwhile(self.target.owner, plan.call, ran, after, rewrites, weights_written) \
                if isinstance(error, VerificationError) else None
            if meanwhile is not None:
                return self._unmade(f"{meanwhile} ({first_line(error)})", generation, out)
            return self._refuse(plan.call, f"capture failed: {error}{_writes_itself(ran, error)}", generation,
                                lambda: out, plan.point or _refused_at(error))
        finally:
            put_back()
        changed = _changed(self.target.owner, plan.call, attempt, weights_written)
        if changed is not None:
            return self._unmade(changed, generation, out)
        written = rewrites.of(ran)
        snapshot = after.without(written)
        seen = reads.read(codes, before.holders)
        attempt.notes.extend(_unwatched(attempt.capture, written))
        for note in attempt.said:
            self._say_once(note)
        if hooked:
            self._say_once(_keeping(hooked))
        self._said_precision(attempt.capture, attempt.notes)
        with self.lock:
            held = len(self.table.captures)
            self.table, taught = _installed(self.table, self.target, attempt, generation, snapshot, written, seen)
            dropped = held + 1 > len(self.table.captures)
        if taught is not None:  # outside the lock: disk I/O
            restore.remember(self.target, taught)
        if dropped:  # a superseded or evicted capture's session is gone: its memory too
            memory.give_back()
        return out


class _Rewrites:
    """What the target writes itself: what moved during its eager run and moved again while an
    export ran its Python (from ``after``, the state between). What moved during the eager run
    only was written by another thread meanwhile (a server's config endpoint), or once: it stays
    watched. Noted as each trace returns: the exporter puts module attributes back after."""

    def __init__(self, after: Snapshot) -> None:
        self.after = after
        self.moved: frozenset[tuple[str, str]] | None = None  # None: no trace ran (restored from disk)

    def __call__(self) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        try:
            with _disable_current_modes():  # comparing values must not be traced
                moved = self.after.moved(traced=True)
        except Exception:  # an entry that cannot be compared now: taken as written
            moved = frozenset((part.name, key) for part in self.after.parts for key in part.keys)
        self.moved = moved if self.moved is None else self.moved | moved

    def of(self, ran: staleness.Written) -> staleness.Written:
        """Of what moved during the eager run (``ran``), what the target wrote."""
        return ran if self.moved is None else ran & self.moved


def _installed(table: CacheTable, target: Target, attempt: degrade.Attempt, generation: int, snapshot: Snapshot,
               written: staleness.Written, seen: reads.Reads) -> tuple[CacheTable, Knowledge | None]:
    """The table with the new capture, its ``snapshot`` watching what this capture and the others
    read (``seen``; the caller holds the lock), and what the function learned when the capture
    taught it something new. The table unchanged where the capture serves nothing: ``reset()``
    or a failure elsewhere since it began, or weights re-assigned while it was made."""
    plan, capture = attempt.plan, attempt.capture
    if table.generation != generation or table.state is State.Fallback:
        return table, None
    with TARGETS.shared():
        if any(b.changed() for b in capture.baked):  # (the watch counts registrations from now on)
            return table, None  # the next call captures again
        moved = table.snapshot.moved() - table.written - written if table.captures else ()
    table = replace(table, written=table.written | written, reads=table.reads | seen)
    if moved:  # the state moved since the other captures were made (not by the target itself)
        table = without(table, table.captures, pending=None, spends=False)
    knowledge = learned(table.knowledge, plan, target.options, static_axes=attempt.static_axes,
                        unliftable=attempt.unliftable)
    superseded = [c for ref in plan.replaces if (c := ref()) is not None and _covers(capture, c)]
    for note in attempt.notes:
        logger.info("capture of %s: %s", target.name, note)
    if plan.reason is not None:
        logger.info("re-capture of %s: %s", target.name, plan.reason)
    installed = with_capture(table, capture, reason=plan.reason, spends=plan.spends, replaces=superseded,
                             knowledge=knowledge, notes=attempt.notes, limit=config.cache_size,
                             snapshot=snapshot.narrowed(table.reads))
    return installed, (knowledge if knowledge.learned != table.knowledge.learned else None)


_LIVE: "weakref.WeakSet[Lifecycle]" = weakref.WeakSet()  # every function's, for a forked child


def _renewed_in_child() -> None:
    """A forked child has none of the parent's other threads: a capture one of them was making is
    not in flight here (its key would have run eagerly for good), and a lock it held would never
    be released."""
    for lifecycle in list(_LIVE):
        lifecycle.lock = threading.RLock()
        lifecycle._inflight = set()


os.register_at_fork(after_in_child=_renewed_in_child)


def _writes_itself(ran: staleness.Written, error: CaptureError) -> str:
    """Why a graph disagreed with eager, where the target writes its own state as it runs."""
    return f" (the target writes {staleness.words(ran)} itself, which a graph cannot)" \
        if ran and isinstance(error, VerificationError) else ""


def _refused_at(error: CaptureError) -> Any:
    """What a key's failed first capture refuses: its calls with a size 0, where the graph's
    kernels cannot run empty ones (``EMPTY``); else the whole key (``None``)."""
    return EMPTY if isinstance(error, EmptyKillsError) else None


def _keeping(hooked: Sequence[tuple[str, Any]]) -> str:
    keeping = sorted({name for name, _ in hooked})
    return (f"forward hooks on {staleness.listed(keeping, repr)} keep what they see in a dict or list: "
            "served calls run the graph, not the hooks, so those stay as the last eager call left "
            "them (ask the model for the values instead: output_hidden_states=True, a returned tensor)")


_SWITCHED = "model changed while capturing: its training flag was switched"


def _meanwhile(owner: torch.nn.Module | None, call: Call, ran: staleness.Written, after: Snapshot,
               rewrites: _Rewrites, weights_written: Callable[[], bool]) -> str | None:
    """Why a graph disagreed with its eager run when another thread changed the model while it was
    made (a training step's in-place update, an attribute set after the eager run read it): the
    failure is the change's, not the graph's. Another thread's are the entries that moved after
    the eager run but not in it, and those that moved in it but not again when traced.
    ``None``: nothing changed but what the target wrote."""
    if _switched(owner, call):
        return _SWITCHED
    if weights_written():
        return "model changed while capturing: weights written in place"
    with TARGETS.shared():
        since = after.moved() - ran  # moved after the eager run, which did not write it
    others = since if rewrites.moved is None else since | (ran - rewrites.moved)
    return f"model changed while capturing: {staleness.words(others)}" if others else None


def _changed(owner: torch.nn.Module | None, call: Call, attempt: degrade.Attempt,
             weights_written: Callable[[], bool]) -> str | None:
    """Why a capture made must not be installed, when the model changed since its eager run: the
    training flag switched, or weights written under a graph the disk cache gave (found, and
    verified, for the weights the eager run had; a graph exported meanwhile bakes those it reads,
    and its watch sees later writes)."""
    if _switched(owner, call):
        return _SWITCHED
    if attempt.restored and weights_written():
        return "model changed while capturing: weights written in place or replaced"
    return None


def _switched(owner: torch.nn.Module | None, call: Call) -> bool:
    """Whether the model's training flag is no longer the one the call was keyed by: another
    thread called ``train()`` or ``eval()`` while the call ran (or its export traced). The graph
    would hold the other mode's computation under this key: it is not made, and the next call
    with the key captures."""
    return owner is not None and call.key.training is not None and owner.training != call.key.training


def _hooks(owner: torch.nn.Module | None) -> bool:
    """Whether a forward hook runs in a call of ``owner`` (its own modules', or torch's global ones)."""
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        return True
    return owner is not None and any(m._forward_hooks or m._forward_pre_hooks for m in owner.modules())


def _covers(new: Capture, old: Capture) -> bool:
    """Whether ``new`` serves what ``old`` served: its guard accepts the call ``old`` was made from
    (a graph traced at size 1 stays beside a dynamic one, which was traced for sizes from 2)."""
    return not new.guard.mismatches(old.example)


def _unwatched(capture: Capture, written: staleness.Written) -> list[str]:
    """Notes on what a capture cannot watch: inference tensors, the state the target writes."""
    notes = []
    unseen = [b.name for b in capture.baked if b.version is None]
    if unseen:
        what = "is an inference tensor" if len(unseen) == 1 else "are inference tensors"
        notes.append(f"{staleness.listed(unseen, repr)} {what} (made under torch.inference_mode()): "
                     "in-place updates to it cannot be seen; call f.reset() after one")
    if written:
        notes.append(f"{staleness.words(written)} written by the target itself: not watched, "
                     "and served calls do not write it")
    return notes
