"""How a capture serves a call: the closures of the hot path.

``closures`` makes two per capture, over plain data (never over the capture itself, so a dropped
capture and its session are freed as soon as the last call using them returns):

- ``run(feeds)``: the fed leaves -> the output tree, for a call the caller has matched;
- the flat hit, for calls whose canonical form is a tuple of plain tensors and simple constants
  (``f(x)``, ``f(ids, mask)``, ``f(x, None, "relu")``): it skips flatten, key and lookup and
  compares each argument with the capture's key directly, then runs the guard and ``run``.

``general`` is the hit for every other call: flatten, key, lookup, guard. Each decides exactly
what the miss path would decide for a call it serves; whatever they decline goes to the miss path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import optree
import torch

import serving
from clika_runtime.base.precision import NON_FINITE
from clika_runtime.capture.envelope import Eagerly, Envelope, extent
from clika_runtime.guards.guard import Guard
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.key import CallKey


@dataclass
class Stats:
    """How a capture has been used. Written by hits without a lock: statistics only (a lost
    increment under a race is harmless); they order evictions and name the current capture."""

    hits: int = 0
    last_use: float = field(default_factory=time.monotonic)  # orders evictions: least recent first
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the capture

    def touch(self) -> None:
        """Count one served call."""
        self.hits += 1
        self.last_use = _monotonic()


MISS = object()  # what a hit returns for a call it does not serve

_monotonic = time.monotonic

NO_LIFT: frozenset[int] = frozenset()

_Tensor = torch.Tensor

# Constants the flat hit compares with ``type(a) is kind and a == value``. Floats are left to the
# general path (NaN and -0.0 need its care), and so are lifted numbers (they feed the graph).
_CONSTANTS = (type(None), bool, int, str)


class RunFailed(Exception):
    """A graph failed on inputs its guard accepted (``feeds``, as fed to it)."""

    def __init__(self, capture: Any, error: Exception, feeds: Sequence[Any]) -> None:
        super().__init__(str(error))
        self.capture, self.error, self.feeds = capture, error, feeds


@dataclass(frozen=True)
class Parts:
    """What a capture serves with: its runner and how to turn graph outputs into the output tree."""

    runner: serving.TorchRunner
    out_spec: optree.PyTreeSpec
    eager_leaves: list[Any]  # the capturing call's output leaves: the template of every output
    constants: dict[int, Any]  # output leaves baked at capture, by position
    graph_leaves: list[int]  # output positions the graph computes
    scalar_out: dict[int, type]  # of those, the Python numbers (sizes) returned as numbers
    lift: tuple[int, ...]  # feed indices of lifted Python numbers (fed as int64 scalars)
    owner: torch.nn.Module | None = None
    envelope: Envelope | None = None  # an int8 graph's: the calls it was checked on


def closures(
    parts: Parts, guard: Guard, key: CallKey, positions: Sequence[int], stats: Stats
) -> tuple[Callable[[Sequence[Any]], Any], Callable[[tuple], Any] | None]:
    """The capture's ``run`` and flat hit (``None`` when its key is not a flat call)."""
    run = _run(parts, stats)
    if parts.envelope is not None:
        run = _reduced(run, parts.envelope)
    flat = _flat(key, positions, parts.owner, guard, run) if not parts.lift else None
    return run, flat


def _run(parts: Parts, stats: Stats) -> Callable[[Sequence[Any]], Any]:
    graph_run, touch = parts.runner.run, stats.touch
    if not parts.constants and not parts.scalar_out and not parts.lift:
        if parts.out_spec.is_leaf():  # one tensor out, the most common case: no tree to rebuild

            def run_one(feeds: Sequence[Any]) -> Any:
                stats.hits += 1  # Stats.touch, written out: a method call costs as much again
                stats.last_use = _monotonic()
                (out,) = graph_run(feeds)
                return out

            return run_one
        rebuild = trees.rebuilder(parts.out_spec, parts.eager_leaves)

        def run_tree(feeds: Sequence[Any]) -> Any:
            touch()
            return rebuild(graph_run(feeds))

        return run_tree
    template = [None] * len(parts.eager_leaves)
    for pos, value in parts.constants.items():
        template[pos] = value
    slots = [(pos, parts.scalar_out.get(pos)) for pos in parts.graph_leaves]
    unflatten, lift = parts.out_spec.unflatten, parts.lift

    def run(feeds: Sequence[Any]) -> Any:
        touch()
        if lift:
            feeds = list(feeds)
            for i in lift:
                feeds[i] = torch.tensor(feeds[i])
        leaves = list(template)
        for (pos, scalar), value in zip(slots, graph_run(feeds)):
            leaves[pos] = scalar(value.item()) if scalar is not None else value
        return unflatten(leaves)

    return run


def _reduced(run: Callable[[Sequence[Any]], Any], envelope: Envelope) -> Callable[[Sequence[Any]], Any]:
    """``run`` for an int8 graph, raising ``Eagerly`` for feeds holding NaN or an infinity
    (``base.precision.non_finite``) and for feeds wider than those it was checked on
    (``envelope``: with the graph's answer to judge while the envelope is open). Both read
    ``extent``: a reduction per axis of each float feed (its loudness along that axis)."""

    def checked(feeds: Sequence[Any]) -> Any:
        spans = extent(feeds)
        at = next((i for i, (_, largest, _) in enumerate(spans) if not math.isfinite(largest)), None)
        if at is not None:
            raise Eagerly(f"input {at} {NON_FINITE}")
        if not envelope.holds(spans):
            raise Eagerly("wider than checked", envelope.checker(spans, run(feeds)) if envelope.open else None)
        return run(feeds)

    return checked


def _flat(
    key: CallKey, positions: Sequence[int], owner: torch.nn.Module | None, guard: Guard,
    run: Callable[[Sequence[Any]], Any],
) -> Callable[[tuple], Any] | None:
    """The flat hit of a capture whose canonical call is a tuple of tensors and simple constants."""
    count = len(positions) + len(key.statics)
    if key.structure != _flat_spec(count):
        return None  # containers, or keywords that name no positional parameter
    if not all(type(s) is tuple and s[0] in _CONSTANTS for s in key.statics):
        return None
    fed = set(positions)
    fixed = tuple((i, kind, value) for i, (kind, value) in zip((i for i in range(count) if i not in fed), key.statics))
    picks, training, fits, tensor = tuple(positions), key.training, guard.fits, torch.Tensor
    if count == 1 and not fixed:
        return _one_tensor(owner, training, fits, run)

    def hit(args: tuple) -> Any:
        if len(args) != count:
            return MISS
        for i, kind, value in fixed:
            a = args[i]
            if type(a) is not kind or a != value:
                return MISS
        feeds = [args[i] for i in picks] if fixed else args
        for a in feeds:
            # Exact type: subclasses (Parameter, wrappers) and tensors needing grad go the general way.
            if type(a) is not tensor or a.requires_grad:
                return MISS
        if owner is not None and owner.training is not training:
            return MISS
        if not fits(feeds):
            return MISS
        try:
            return run(feeds)
        except Eagerly:  # answered by the target: not the graph's failure
            raise
        except Exception:  # the general path decides again and handles the failure (re-capture)
            return MISS

    return hit


def _one_tensor(owner: torch.nn.Module | None, training: bool | None, fits: Callable[[Sequence[Any]], bool],
                run: Callable[[Sequence[Any]], Any]) -> Callable[[tuple], Any]:
    """``f(x)``, the most common call: the flat hit without its loops."""
    tensor = torch.Tensor

    def hit(args: tuple) -> Any:
        if len(args) != 1:
            return MISS
        a = args[0]
        if type(a) is not tensor or a.requires_grad or (owner is not None and owner.training is not training):
            return MISS
        if not fits(args):
            return MISS
        try:
            return run(args)
        except Eagerly:  # answered by the target: not the graph's failure
            raise
        except Exception:  # the general path decides again and handles the failure (re-capture)
            return MISS

    return hit


def _flat_spec(count: int) -> optree.PyTreeSpec:
    """The structure of a canonical call of ``count`` positional leaves and no keywords."""
    return trees.flatten(((0,) * count, {}))[1]
