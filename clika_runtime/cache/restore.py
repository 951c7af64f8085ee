"""Captures to and from the on-disk cache (diskcache.py holds the files; this turns a capture into
an entry and an entry back into a capture).

An entry holds the graph and what its capture knew beyond it: the plan that worked (after the
degrade ladder: the dynamic axes, the lifted numbers), the guard, which output leaves the graph
computes, the names of the tensors it baked, and what the retries gave up. Restoring needs the
eager result of the call in hand (the first call of a process computes it anyway): the output
tree and constant leaves come from it, and the graph serves only once it agrees with it.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from clika_runtime.base.sharing import TARGETS
from clika_runtime.base.specs import TensorInfo
from clika_runtime.cache import diskcache, fingerprint
from clika_runtime.capture import assembly
from clika_runtime.capture import capture as capture_mod
from clika_runtime.capture.plan import CapturePlan, Knowledge, declared_axes
from clika_runtime.capture.target import Target
from clika_runtime.capture.value import Capture
from clika_runtime.format import graphfile, treedesc
from clika_runtime.guards import json_form as guards
from clika_runtime.shipped.folder import GraphFolder
from clika_runtime.state.weights import found_again
from clika_runtime.trees import pytrees as trees

logger = logging.getLogger("clika_runtime")


@dataclass(frozen=True)
class Slot:
    """Where one capture lives in the cache."""

    cache: diskcache.DiskCache
    key: str


def _not_fingerprinted(target: Target, error: Exception) -> None:
    logger.debug("disk cache: %s not fingerprinted: %s: %s", target.name, type(error).__name__, error)


def slot_for(target: Target, plan: CapturePlan) -> Slot | None:
    """The cache slot of a plan (``None`` when the cache is off)."""
    cache = diskcache.active()
    if cache is None:
        return None
    try:
        function = fingerprint.function_key(target)
    except Exception as e:  # a target the fingerprint cannot read: no cache for it, never an error
        _not_fingerprinted(target, e)
        return None
    return Slot(cache, fingerprint.capture_key(function, plan, target.place_for(plan.call.feeds).primary))


@dataclass(frozen=True)
class Ready:
    """A cache lookup done beside the eager call of the capture that makes it: the slot, and
    when the cache holds the plan's graph, its files linked and checked and its session open."""

    slot: Slot
    entry: diskcache.Entry | None = None
    folder: GraphFolder | None = None
    session: Any = None


@dataclass(frozen=True)
class Ahead:
    """A lookup under way for ``plan`` (``ahead``)."""

    plan: CapturePlan
    future: "Future[Ready | None]"

    def ready(self) -> Ready | None:
        """Its result; ``None`` when it found no slot or failed (the lookup is then made again)."""
        try:
            return self.future.result()
        except Exception as e:  # a lookup is never an error: the usual path runs instead
            logger.debug("disk cache: lookup ahead failed: %s: %s", type(e).__name__, e)
            return None


# Lookups ahead run here: hashing weights, linking files and opening a session release the GIL, so
# they overlap the eager call (BERT-base's warm first call: the hash and the session, 0.3 s of it).
_AHEAD = ThreadPoolExecutor(max_workers=2, thread_name_prefix="clika_runtime-cache")


def _renewed_in_child() -> None:
    """A forked child has none of the pool's threads, but the pool counts them as started: it
    would queue lookups no thread runs, and a capture would wait for one for ever."""
    global _AHEAD
    _AHEAD = ThreadPoolExecutor(max_workers=2, thread_name_prefix="clika_runtime-cache")


os.register_at_fork(after_in_child=_renewed_in_child)


def ahead(target: Target, plan: CapturePlan) -> Ahead | None:
    """Start looking ``plan`` up in the disk cache (``None`` when the cache is off)."""
    if diskcache.active() is None:
        return None
    return Ahead(plan, _AHEAD.submit(_ready, target, plan))


def _ready(target: Target, plan: CapturePlan) -> Ready | None:
    try:
        fingerprint.warm(target)  # one thread: the eager call has the other core
    except Exception as e:  # a target the fingerprint cannot read: no cache for it, never an error
        _not_fingerprinted(target, e)
        return None
    slot = slot_for(target, plan)
    if slot is None:
        return None
    entry = slot.cache.load(slot.key)
    if entry is None:
        return Ready(slot)
    folder = _linked(entry, slot)
    place = target.place_for(plan.call.feeds)
    return Ready(slot, entry, folder, assembly.open_served(folder, place, target.optimize, keep_optimized=True))


def restore(slot: Slot, target: Target, plan: CapturePlan, out: Any,
            ready: Ready | None = None) -> tuple[Capture, CapturePlan, dict] | None:
    """The capture cached for ``plan``, verified against ``out``; ``None`` when there is none or
    it does not serve this call (a debug line says why). ``ready``: the lookup made ahead."""
    entry = ready.entry if ready is not None else slot.cache.load(slot.key)
    if entry is None:
        return None
    try:
        made, used = _made(entry, target, plan, out, slot, ready.folder if ready is not None else None)
        capture = assembly.assemble(made, target.place_for(used.call.feeds), target.optimize, target.owner,
                                       keep_optimized=True, session=ready.session if ready is not None else None)
    except Exception as e:  # stale, foreign or anything unforeseen: a cache entry is never an error
        logger.debug("disk cache: entry %s not used: %s: %s", slot.key, type(e).__name__, e)
        return None
    logger.info("capture of %s: graph found in the disk cache", target.name)
    return capture, used, entry.meta


def store(slot: Slot, capture: Capture, plan: CapturePlan, notes: list[str],
          static_axes: list[tuple[str, int]], unliftable: frozenset[int], graph_name: str) -> None:
    """Keep a new capture for later processes (an unwritable cache is turned off, said once)."""
    parts = capture.parts
    baked = [(b.name, b.kind) for b in capture.baked if not _made_by_the_trace(b.name, b.kind)]
    lost = [name for name, kind in baked if kind == "constant"]
    if lost:  # a tensor of the user's it baked cannot be found again by name: a later process could not watch it
        logger.debug("disk cache: the capture of %s is not kept: %s baked, which a later process cannot find by "
                     "name to watch", graph_name, ", ".join(map(repr, lost[:4])))
        return
    meta = {
        "graph_name": graph_name, "model": GraphFolder.MODEL, "names": list(capture.names),
        "lifted": sorted(plan.call.lifted), "dynamic": [{str(a): n for a, n in d.items()} for d in plan.dynamic],
        "guard": guards.to_json(capture.guard), "graph_leaves": list(parts.graph_leaves),
        "scalar_out": {str(p): t.__name__ for p, t in parts.scalar_out.items()}, "baked": baked,
        "outputs": [list(o) for o in capture.outputs], "notes": notes,
        "static_axes": [list(a) for a in static_axes], "unliftable": sorted(unliftable),
    }
    try:
        meta["digests"] = capture.folder.digests()  # what take_graph() hands out is checked by them
        slot.cache.save(slot.key, capture.folder.files(), meta)
    except OSError as e:
        diskcache.refuse(slot.cache.root, e)


# The names torch.export gives the tensors a trace makes itself (``torch.tensor(...)`` in a forward,
# a mask built from constants): they are in the graph, the code that makes them is in the key,
# and there is nothing of the user's to watch.
_TRACE_MADE = re.compile(r"(^|\.)(lifted_tensor_\d+|_tensor_constant\d+)$")


def _made_by_the_trace(name: str, kind: str) -> bool:
    return kind == "constant" and _TRACE_MADE.search(name) is not None


def _made(entry: diskcache.Entry, target: Target, plan: CapturePlan, out: Any, slot: Slot,
          folder: GraphFolder | None = None) -> tuple[assembly.Made, CapturePlan]:
    meta = entry.meta
    call = plan.call
    lifted = frozenset(meta["lifted"])
    if lifted != call.lifted:
        call = call.with_lift(lifted, target.owner)
    dynamic = tuple({int(a): n for a, n in d.items()} for d in meta["dynamic"])
    used = replace(plan, call=call, dynamic=dynamic, declared=declared_axes(call, target.options))
    device = next((str(t.device) for t in call.feeds if hasattr(t, "device")), "cpu")
    guard = replace(guards.from_json(meta["guard"]), device=device, verify_small=True)
    problem = guard.check(call.feeds)
    if problem is not None:
        raise ValueError(f"its guard refuses this call: {problem}")
    with TARGETS.shared():  # looking in the module: not while an export elsewhere swaps its tensors for fakes
        baked = found_again([tuple(b) for b in meta["baked"]], target.owner, target.fn)
    if baked is None:
        raise ValueError("a tensor it baked is not found in this process")
    leaves = trees.flatten(out)[0]
    graph_leaves = [int(p) for p in meta["graph_leaves"]]
    folder = folder or _linked(entry, slot)
    made = assembly.Made(
        plan=used, eager_out=out, folder=folder, guard=guard, graph_leaves=graph_leaves,
        constants={i: leaf for i, leaf in enumerate(leaves) if i not in graph_leaves},
        scalar_out={int(p): treedesc.SCALAR_TYPES[t] for p, t in meta["scalar_out"].items()},
        names=capture_mod.output_names_of(out, leaves, target.output_names, call.names),
        baked=tuple(baked), outputs=tuple(TensorInfo(n, d, tuple(s)) for n, d, s in meta["outputs"]), phases={},
        precision=target.precision, agreement=target.agreement_now(),
        precision_note=next((n for n in meta.get("notes", ()) if n.startswith(f"{target.precision} not served")), None),
    )
    return made, used


def _linked(entry: diskcache.Entry, slot: Slot) -> GraphFolder:
    """The entry's files in a folder of their own, checked as any graph file is (data in its folder, no
    code), with the digests of those a capture hands out."""
    folder = GraphFolder(slot.cache.work)
    folder.recorded = MappingProxyType(dict(entry.meta.get("digests", {})))
    for path in entry.files:
        diskcache.link_or_copy(path, folder.path / path.name)
    for path in folder.path.glob("*.onnx"):
        graphfile.check(path)
    return folder


def remember(target: Target, knowledge: Knowledge) -> None:
    """Keep what drift taught a function, so a later process plans its first capture dynamic."""
    cache = diskcache.active()
    if cache is None or not knowledge.learned:
        return
    data = {
        "learned": {name: {str(a): n for a, n in axes.items()} for name, axes in knowledge.learned.items()},
        "static_axes": sorted([list(a) for a in knowledge.static_axes]),
        "untied": sorted(sorted([list(p) for p in pair]) for pair in knowledge.untied),
    }
    try:
        key = fingerprint.code_key(target)
    except Exception as e:  # a target the fingerprint cannot read: nothing kept for it
        _not_fingerprinted(target, e)
        return
    try:
        cache.remember(key, data)
    except OSError as e:
        diskcache.refuse(cache.root, e)


def forget(target: Target) -> None:
    """The target's weights are hashed afresh for its next cache key (``fingerprint.forget``)."""
    try:
        fingerprint.forget(target)
    except Exception as e:  # nothing kept for a target the fingerprint cannot read
        logger.debug("disk cache: %s digests not dropped: %s: %s", target.name, type(e).__name__, e)


def recall(target: Target) -> Knowledge | None:
    """What an earlier process learned about this function, or ``None``."""
    cache = diskcache.active()
    try:
        data = cache.knowledge(fingerprint.code_key(target)) if cache is not None else None
    except Exception as e:  # a target the fingerprint cannot read: no cache for it, never an error
        _not_fingerprinted(target, e)
        return None
    if not data:
        return None
    try:
        learned = {str(n): MappingProxyType({int(a): d for a, d in axes.items()}) for n, axes in data["learned"].items()}
        return Knowledge(
            learned=MappingProxyType(learned),
            static_axes=frozenset((str(f), str(n), int(a)) for f, n, a in data["static_axes"]),
            untied=frozenset(frozenset((str(n), int(a)) for n, a in pair) for pair in data["untied"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        logger.debug("disk cache: what the function learned is unreadable (%s), ignored", e)
        return None
