"""The state of one compiled function: an immutable ``CacheTable``, replaced whole on every change.

Hits read the table a function holds at that moment and nothing else; misses, ``reset()``,
evictions and new captures build a new table and swap it in under the function's lock. A hit thus
sees either the old table or the new one, never half of each, and needs no lock.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from clika_runtime.capture.plan import Knowledge
from clika_runtime.state.reads import Reads
from clika_runtime.state.snapshot import Snapshot, with_modes
from clika_runtime.state.weights import Watch
from clika_runtime.trees.key import CallKey, Described

if TYPE_CHECKING:
    from clika_runtime.capture.value import Capture

# Graphs kept per key for sizes on either side of a branch the trace took (`if seq == 1:`), and for
# sizes 0/1, which get graphs of their own (two dynamic axes: nine combinations of 0, 1 and the
# rest), so calls alternating across them stop re-capturing. Past it the least recently used goes.
VARIANTS = 8
# Re-capture reasons and capture notes a function keeps, the most recent: a long-lived server
# that hot-swaps its weights re-captures without end, and each new table copies them.
WORDS_KEPT = 1000


class State(enum.Enum):
    """Where the function is in its capture lifecycle.

    ``Pending``: nothing captured yet. ``Compiled``: a captured graph serves calls whose structure
    and shapes it matches. ``Fallback``: serving eagerly, and not re-capturing, until ``reset()``.
    """

    Pending = "pending"
    Compiled = "compiled"
    Fallback = "fallback"


@dataclass(frozen=True)
class CacheTable:
    """Everything a compiled function knows, as one value.

    ``entries`` maps a key to its captures (one, or a few variants), in least-recently-captured
    order; ``flat`` is the flat hit of the newest capture; ``watch`` checks the baked weights;
    ``snapshot`` the Python state the captures read (attributes, hooks, globals), but
    ``written``, what the target's own calls write (``self.last_batch = ...``), and of its
    objects' attributes only those the captures' code names (``reads``: not the caller's bookkeeping);
    ``fresh`` is the per-call check of both, and that the call is plain (no autocast, mode or
    trace: ``snapshot.plain_call``; one attribute away from a call);
    ``pending`` is the reason the next capture will give (a graph dropped, weights changed), and
    ``pending_spends`` whether that capture spends the re-capture budget;
    ``refused``: keys whose capture failed (a training-mode call, a dtype onnxruntime cannot
    run, a call that mutates an input), each with the key in words and why: their calls serve
    eagerly, the other keys keep capturing (``None``: calls that cannot be keyed at all; a
    ``(key, point)`` pair: the sizes whose variant failed, the key's other sizes still served);
    ``spent``: the re-captures that spent it (drift, a number that varies, a graph that failed,
    captures dropped or evicted before they served a call). New keys and weights or state that
    changed after their graph served are re-captures too (``recaptures``), but not spent:
    ``config.cache_size`` bounds keys, and a graph that served paid for itself.
    """

    state: State = State.Pending
    entries: Mapping[CallKey, tuple["Capture", ...]] = field(default_factory=lambda: MappingProxyType({}))
    flat: Callable[[tuple], Any] | None = None
    watch: Watch = field(default_factory=lambda: Watch(()))
    snapshot: Snapshot = field(default_factory=lambda: Snapshot([]))
    written: frozenset[tuple[str, str]] = frozenset()  # state the target writes itself: not watched
    reads: Reads = field(default_factory=Reads)  # the attribute names the captures' code names
    fresh: Callable[[], bool] = field(default=lambda: True)
    knowledge: Knowledge = field(default_factory=Knowledge)
    recaptures: int = 0
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    fallback_why: str | None = None
    pending: str | None = None
    pending_spends: bool = False
    refused: Mapping[Any, tuple[str, str]] = field(default_factory=lambda: MappingProxyType({}))  # see above
    refused_still: Callable[[], bool] = field(default=lambda: True)  # False once the weights were converted
    retried: int = 0  # times the refused keys were tried again (``retrying_refused``): at most the re-capture limit
    spent: tuple[str, ...] = ()
    last: Described | None = None  # the key of the last capture made (explains misses when none is cached)
    last_names: tuple[str, ...] = ()  # its graph input names
    generation: int = 0

    @property
    def captures(self) -> list["Capture"]:
        """Every cached capture, oldest key first."""
        return [c for variants in self.entries.values() for c in variants]

    def current(self) -> "Capture | None":
        """The capture most recently created or served."""
        captures = self.captures
        return max(captures, key=lambda c: c.stats.last_use) if captures else None

    def to_ship(self) -> "Capture | None":
        """The capture ``take_graph()`` hands out: of the most recently used key's captures, the
        one with the most dynamic axes (a variant made for size 1 serves size 1 alone)."""
        current = self.current()
        if current is None:
            return None
        return max(self.entries[current.key], key=lambda c: (sum(map(len, c.dynamic)), c.stats.last_use))


def empty(generation: int) -> CacheTable:
    """The table of a function with nothing captured."""
    return CacheTable(generation=generation)


def with_capture(
    table: CacheTable, capture: "Capture", *, reason: str | None, spends: bool, replaces: Sequence["Capture"] = (),
    knowledge: Knowledge, notes: Sequence[str] = (), limit: int, snapshot: Snapshot,
) -> CacheTable:
    """``table`` with ``capture`` installed beside the variants of its key (without ``replaces``),
    least recently used keys evicted past ``limit``; ``reason`` (None: the first capture) counts
    as one re-capture, and ``spends`` the budget; ``snapshot``: the state the capture read (the
    others must have read the same)."""
    entries = dict(table.entries)
    kept = tuple(c for c in entries.pop(capture.key, ()) if c not in replaces)
    entries[capture.key] = _recent(kept, capture)
    spent = table.spent + ((reason,) if reason and spends else ())
    while len(entries) > max(1, limit):
        oldest = min(entries, key=lambda k: max(c.stats.last_use for c in entries[k]))
        if not any(c.stats.hits for c in entries.pop(oldest)):  # keys in rotation past the cache's size
            spent += (f"a key evicted before it served a call (more keys in use than cache_size={limit}; "
                      "raise cr.config.cache_size)",)
    return _rebuilt(
        table, entries, flat=capture.flat, state=State.Compiled, knowledge=knowledge, pending=None,
        pending_spends=False, last=capture.described, last_names=capture.names, notes=_kept(table.notes, notes),
        recaptures=table.recaptures + (reason is not None), reasons=_kept(table.reasons, [reason] if reason else []),
        spent=spent, snapshot=snapshot,
    )


def _kept(words: tuple[str, ...], more: Sequence[str]) -> tuple[str, ...]:
    """``words`` then ``more``, the most recent ``WORDS_KEPT`` of them."""
    return (words + tuple(more))[-WORDS_KEPT:] if more else words


def _recent(kept: tuple["Capture", ...], new: "Capture") -> tuple["Capture", ...]:
    """A key's captures with ``new``, at most ``VARIANTS``: the least recently used go (the
    general dynamic graph, which serves most calls, stays however old it is)."""
    while len(kept) >= VARIANTS:
        stalest = min(kept, key=lambda c: c.stats.last_use)
        kept = tuple(c for c in kept if c is not stalest)
    return kept + (new,)


def without(table: CacheTable, dropped: Sequence["Capture"], pending: str | None, spends: bool | None = None) -> CacheTable:
    """``table`` without some captures (a graph that failed, stale weights); the next capture says
    why, and spends the budget when ``spends`` says so (``None``: when none of them served a call,
    as with weights that change on every call: a weights or state change spends only then)."""
    entries = {k: tuple(c for c in v if c not in dropped) for k, v in table.entries.items()}
    entries = {k: v for k, v in entries.items() if v}
    flat = table.flat if all(c.flat is not table.flat for c in dropped) else None
    if spends is None:
        spends = bool(dropped) and not any(c.stats.hits for c in dropped)
    return _rebuilt(table, entries, flat=flat, pending=pending, pending_spends=spends)


def unmade(table: CacheTable, why: str) -> CacheTable:
    """``table`` after a capture that was not made because the model changed while it was being
    made (another thread): the next call with its key captures again, with ``why`` as its reason,
    and ``why`` has spent the budget (a model changed on every call runs out of it)."""
    return replace(table, pending=why, pending_spends=False, spent=table.spent + (why,))


def swapped(table: CacheTable, old: "Capture", new: "Capture", note: str) -> CacheTable:
    """``table`` with ``new`` in ``old``'s place (a guard that refuses more), and ``note`` said."""
    entries = {k: tuple(new if c is old else c for c in v) for k, v in table.entries.items()}
    flat = new.flat if table.flat is old.flat else table.flat
    return _rebuilt(table, entries, flat=flat, notes=_kept(table.notes, [note]))


def noted(table: CacheTable, note: str) -> CacheTable:
    """``table`` with ``note`` said (``f.capture_notes``)."""
    return _rebuilt(table, dict(table.entries), notes=_kept(table.notes, [note]))


def rewatched(table: CacheTable, snapshot: Snapshot | None = None) -> CacheTable:
    """``table`` with a new weights watch (after a registration that changed nothing baked), and
    ``snapshot`` when given (after a change of state no capture read)."""
    return _rebuilt(table, dict(table.entries), snapshot=snapshot or table.snapshot)


REFUSED_KEPT = 64  # keys remembered as refused: past that, the oldest is tried again


def with_refused(table: CacheTable, key: Any, words: str, why: str,
                 still: Callable[[], bool] | None = None) -> CacheTable:
    """``table`` with ``key``'s calls (``words``) served eagerly from now on, for ``why``: until
    ``reset()``, or until ``still()`` turns False (the weights were converted: tried again)."""
    refused = {k: v for k, v in table.refused.items() if k != key}
    refused[key] = (words, why)
    while len(refused) > REFUSED_KEPT:
        del refused[next(iter(refused))]
    return replace(table, refused=MappingProxyType(refused), refused_still=still or table.refused_still)


def retrying_refused(table: CacheTable) -> CacheTable:
    """``table`` with its refused keys to be tried again (the weights were converted since their
    captures failed); calls that cannot be keyed stay eager."""
    kept = {k: v for k, v in table.refused.items() if k is None}
    return replace(table, refused=MappingProxyType(kept), refused_still=lambda: True, retried=table.retried + 1)


def fallen_back(table: CacheTable, why: str) -> CacheTable:
    """``table`` serving eagerly until ``reset()``: its captures (and their sessions) released."""
    return _rebuilt(table, {}, flat=None, state=State.Fallback, fallback_why=why)


def _rebuilt(table: CacheTable, entries: dict, **changes: Any) -> CacheTable:
    captures = [c for variants in entries.values() for c in variants]
    watch = Watch([b for c in captures for b in c.baked])
    snapshot = changes.pop("snapshot", table.snapshot)
    snapshot = snapshot if captures else Snapshot([])  # nothing captured: nothing to watch
    # Weights and state as captured, and a plain call (autocast, modes, traces: the miss path, eager).
    fresh = snapshot.check(watch.fresh) if snapshot.parts else with_modes(watch.fresh)
    return replace(table, entries=MappingProxyType(entries), watch=watch, snapshot=snapshot,
                   fresh=_without_grad(fresh, tuple(b.tensor for b in watch.baked)), **changes)


_grad_enabled = torch.is_grad_enabled
_requires_grad = operator.attrgetter("requires_grad")


def _without_grad(fresh: Callable[[], bool], tensors: tuple) -> Callable[[], bool]:
    """``fresh``, and no call that differentiates through the baked tensors: with grad mode on
    and a baked tensor that requires grad, the call goes the miss path, which runs it eagerly
    (a graph's outputs cannot carry gradients back to the weights). Read per call, not once:
    ``requires_grad_()`` moves no counter. One C call when grad mode is off."""
    if not tensors:
        return fresh

    def check() -> bool:
        return fresh() and not (_grad_enabled() and any(map(_requires_grad, tensors)))

    return check
