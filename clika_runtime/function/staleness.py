"""What a miss checks first: captures whose baked tensors or Python state changed are dropped
(the next capture says which); and the state a capture watches, but what the target writes
itself.

The hot path only asks ``table.fresh()``; when it says no, ``checked`` finds out what moved:
a registration that touched nothing baked, or a change of state no capture reads (a private
attribute, a whole-model ``train()``), gives the same captures a new watch; anything else drops
the captures that read it.
"""

from __future__ import annotations

from typing import Any, Callable

from clika_runtime.base.sharing import TARGETS
from clika_runtime.capture.target import Target
from clika_runtime.function.table import CacheTable, rewatched, without
from clika_runtime.state.snapshot import Snapshot

Written = frozenset[tuple[str, str]]  # ``Snapshot.moved()`` pairs: (part, key)


def checked(table: CacheTable, target: Target) -> CacheTable:
    """``table`` without the captures whose baked tensors or Python state changed."""
    if not table.captures or table.fresh():
        return table
    with TARGETS.shared():  # looking in the module: not while an export elsewhere swaps its parameters
        registered = not table.watch.fresh()  # a registration (a submodule assigned?) or weights moved
        if registered:
            table = _weights_checked(table)
        if table.captures and (registered or not table.snapshot.fresh()):
            table = _state_checked(table, target)
    return table


def snapshot(target: Target, written: Written) -> Snapshot:
    """The Python state the target may read now, but ``written``, before a capture narrows it to
    what its run read (the caller holds ``TARGETS`` shared)."""
    return Snapshot.of(target.fn, target.owner, written)


def words(written: Written) -> str:
    """Entries the target writes, in words: ``'last_batch'``, ``'encoder.last_batch'``."""
    return listed(sorted(written), _entry)


def _weights_checked(table: CacheTable) -> CacheTable:
    changed = [b for b in table.watch.baked if b.changed()]
    if not changed:  # a registration elsewhere: nothing baked moved
        return rewatched(table)
    moved = {id(b.tensor) for b in changed}
    stale = [c for c in table.captures if any(id(b.tensor) in moved for b in c.baked)]
    return without(table, stale, pending=f"weights changed: {listed(changed, lambda b: repr(b.name))}")


def _state_checked(table: CacheTable, target: Target) -> CacheTable:
    again = table.snapshot.retriggered()  # the common case: a hook made elsewhere, looked at cheaply
    if again is not None:
        return rewatched(table, again)
    changed = table.snapshot.changed()
    if not changed:  # what moved is nothing a capture read (a hook made elsewhere, a train()/eval())
        try:
            return rewatched(table, table.snapshot.refreshed())
        except Exception:  # an entry went away since: walk the target again
            return rewatched(table, snapshot(target, table.written).narrowed(table.reads))
    return without(table, table.captures, pending=f"state changed: {listed(changed, str)}")


def _entry(pair: tuple[str, str]) -> str:
    where, key = pair
    return f"'{key}'" if where == "the module" else f"{where} '{key}'" if " " in where else f"'{where}.{key}'"


def listed(items: list[Any], word: Callable[[Any], str]) -> str:
    """The first four of ``items`` in words, and how many more."""
    return ", ".join(word(i) for i in items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
