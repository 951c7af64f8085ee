"""The guard: everything a graph assumes of the inputs it serves, as data, checked in one place.

A ``Guard`` holds, per graph input, its dtype and shape (an int where static, a dim name where
dynamic; one name means one size), the size range the exporter assumed for each dim, the value
range of each lifted Python number, the size conditions the trace branched on (with the value
each had at capture; ``conditions.py`` is their language), and the points outside of those where
the graph was traced and verified all the same (its capture's own call: a decoder's past of 1).
``check(feeds)`` returns the first ``Mismatch`` (or ``None``) and serves both to decide and to
explain. The same guard ships in a graph's metadata as JSON (``json_form.py``) and ``cr.load``
enforces it.

No torch at module level: a loaded graph is guarded on a box with only onnxruntime and numpy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from clika_runtime.guards.conditions import defined, render

# Sizes 0 and 1 are where tracers assume most (broadcasting, 0/1 specialisation): in process, a
# graph serves a dynamic dim at these sizes only where it was traced at them (a ``Verified`` point).
# A shipped graph has no tracer to ask: it refuses size 0 (empty requests are no traffic worth a
# risk: a mean of nothing is NaN in torch, 0 in onnxruntime) and serves size 1, which Triton's
# batches of one and single requests need (docs/DEPLOY.md says what that leaves).
SPECIAL_BELOW = 2
SHIPPED_BELOW = 1
NUMBER_PREFIX = "#"  # starts a lifted number's name where verified points record values by name
_LONGEST = 240  # characters of one mismatch in words


@dataclass(frozen=True)
class InputRule:
    """What one graph input must be: ``shape`` entries are ints (static) or dim names (dynamic);
    ``shape`` is ``None`` for a lifted Python number, whose value must lie in ``number``."""

    name: str
    dtype: str  # as numpy and torch spell it: "float32", "int64", "bfloat16"
    shape: tuple[int | str, ...] | None
    number: tuple[int, int | None] | None = None


@dataclass(frozen=True)
class Verified:
    """A point outside the graph's ranges and conditions where it was traced and verified all the
    same (its capture's own call): calls whose dims listed here have exactly these sizes, and whose
    conditions evaluate to ``outcomes``, are served by this graph (the other dims may take any
    size the guard accepts)."""

    sizes: tuple[tuple[str, int], ...]
    outcomes: tuple[Any, ...]


@dataclass(frozen=True)
class Mismatch:
    """Why a guard refuses a call: ``kind`` is one of ``count``, ``type``, ``dtype``, ``device``,
    ``byteorder`` (a non-native numpy array), ``rank``, ``size`` (a static axis), ``equal`` (dims
    sharing a name differ), ``range`` (a size outside what the exporter assumed), ``number``,
    ``condition`` (a size branch flipped) or ``special`` (size 0 or 1, which the trace assumed
    away). ``range``, ``condition`` and ``special`` are the kinds a variant traced at the call's
    sizes serves."""

    kind: str
    input: str | None
    axis: int | None
    expected: Any
    got: Any
    detail: str = ""

    def __str__(self) -> str:
        where = f"input '{self.input}'" + (f" axis {self.axis}" if self.axis is not None else "")
        text = {
            "count": f"expected {self.expected} inputs, got {self.got}",
            "type": f"{where}: expected {self.expected}, got {self.got}",
            "dtype": f"{where}: expected dtype {self.expected}, got {self.got}",
            "device": f"{where}: expected device {self.expected}, got {self.got}",
            "byteorder": f"{where}: expected {self.expected}, got {self.got}",
            "rank": f"{where}: expected rank {self.expected}, got shape {self.got}",
            "size": f"{where}: expected size {self.expected}, got {self.got}",
            "equal": f"{where}: size {self.got}, but {self.expected} (the graph requires them equal)",
            "range": f"{where}: size {self.got} outside the graph's range {self.expected}",
            "number": f"{where} = {self.got}: outside the graph's range {self.expected}",
            "condition": f"a size condition the graph was traced under changed: {self.detail}",
            "special": f"{where}: size {self.got}, which the trace assumed away (torch.export traces dynamic sizes from 2)",
        }[self.kind]
        return text if len(text) <= _LONGEST else text[:_LONGEST - 3] + "..."  # a ViT/Swin condition runs to KBs


@dataclass(frozen=True)
class Guard:
    """What a graph assumes of its inputs (see the module docstring).

    ``device`` and ``verify_small`` are the in-process part, not shipped: the device fed tensors
    must be on, and whether a dynamic dim at size 0 or 1 needs a ``Verified`` point even inside
    its range (in process, those sizes get a variant traced at them; a shipped graph has no
    tracer to ask, and serves what its ranges and verified points say).
    """

    inputs: tuple[InputRule, ...]
    ranges: tuple[tuple[str, int, int | None], ...] = ()  # dim name, lowest, highest (None: unbounded)
    conditions: tuple[tuple[tuple, Any], ...] = ()  # (tree, value at capture)
    verified: tuple[Verified, ...] = ()
    example: tuple[tuple[str, int], ...] = ()  # each dim's size (and lifted number's value) at capture
    device: str | None = None
    verify_small: bool = False
    # Lookups derived from the fields above, built once; they decide nothing the fields do not say.
    _accept: tuple[frozenset, ...] = field(init=False, repr=False, compare=False)
    _exact: tuple | None = field(init=False, repr=False, compare=False)
    _bounds: dict[str, tuple[int, int | None]] = field(init=False, repr=False, compare=False)
    _points: frozenset = field(init=False, repr=False, compare=False)
    fits: Callable[[Sequence[Any]], bool] = field(init=False, repr=False, compare=False)
    _reads: tuple[frozenset[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        accept = tuple(_dtype_objects(rule.dtype) for rule in self.inputs)
        object.__setattr__(self, "_accept", accept)
        object.__setattr__(self, "_bounds", {name: (lo, hi) for name, lo, hi in self.ranges})
        object.__setattr__(self, "_points", frozenset((v.sizes, v.outcomes) for v in self.verified))
        object.__setattr__(self, "_reads", tuple(_dims_read(self.inputs, tree) for tree, _ in self.conditions))
        static = all(r.shape is not None and all(type(d) is int for d in r.shape) for r in self.inputs)
        exact = None
        if static and not self.conditions and self.device in (None, "cpu"):
            exact = tuple((tuple(r.shape), a) for r, a in zip(self.inputs, accept))
        object.__setattr__(self, "_exact", exact)
        object.__setattr__(self, "fits", _fits(self))

    @property
    def names(self) -> list[str]:
        """The graph input names, in order."""
        return [rule.name for rule in self.inputs]

    def check(self, feeds: Sequence[Any]) -> Mismatch | None:
        """The first reason this graph may not serve ``feeds`` (tensors or arrays, and Python
        numbers for lifted inputs), or ``None`` when it may."""
        exact = self._exact
        if exact is not None and len(feeds) == len(exact):  # the common case, without the walk
            cpu = self.device == "cpu"
            try:
                for feed, (shape, accept) in zip(feeds, exact):
                    if feed.shape != shape or feed.dtype not in accept or (cpu and not feed.is_cpu):
                        break
                else:
                    return None
            except AttributeError:  # not an array: the walk says what it is
                pass
        return next(self._walk(feeds), None)

    def dims_read(self, condition: int) -> frozenset[str]:
        """The dim names (and ``#``-prefixed lifted numbers) condition number ``condition`` reads."""
        return self._reads[condition]

    def mismatches(self, feeds: Sequence[Any]) -> list[Mismatch]:
        """Every reason this graph may not serve ``feeds`` (empty when it may)."""
        return list(self._walk(feeds))

    def outcomes(self, feeds: Sequence[Any]) -> tuple[Any, ...]:
        """Each size condition's value for these feeds (``None`` where it divides by zero)."""
        return tuple(defined(tree, feeds) for tree, _ in self.conditions)

    def point(self, feeds: Sequence[Any]) -> Verified | None:
        """Where ``feeds`` lie outside what the graph was traced for (sizes 0/1, sizes outside a
        range, sizes that flip a condition), as the point a capture from them adds;
        ``None`` when they lie inside (or do not fit the inputs at all)."""
        sizes = self._sizes(feeds)
        outcomes = self.outcomes(feeds)
        involved = set(self._unusual(sizes))
        for reads, (_, expected), now in zip(self._reads, self.conditions, outcomes):
            if now != expected:
                involved |= reads
        if not involved and outcomes == tuple(v for _, v in self.conditions):
            return None
        return Verified(tuple(sorted((d, sizes[d]) for d in involved)), outcomes)

    def refusing(self, feeds: Sequence[Any]) -> "Guard | None":
        """This guard with the range of each dim whose size in ``feeds`` differs from the
        example's cut short of that size, on the example's side (the graph failed there, and
        nothing is known past it); ``None`` when every size is the example's (then the values
        failed it, not the sizes)."""
        example = dict(self.example)
        ranges = dict((name, (lo, hi)) for name, lo, hi in self.ranges)
        moved = False
        for dim, size in self._sizes(feeds).items():
            at = example.get(dim)
            if dim.startswith(NUMBER_PREFIX) or at is None or at == size:
                continue
            lo, hi = ranges.get(dim, (0, None))
            ranges[dim] = (max(lo, size + 1), hi) if size < at else (lo, size - 1 if hi is None else min(hi, size - 1))
            moved = True
        if not moved:
            return None
        return replace(self, ranges=tuple((name, lo, hi) for name, (lo, hi) in ranges.items()))

    def with_example(self, feeds: Sequence[Any]) -> "Guard":
        """This guard, recording the sizes of ``feeds`` as the capture's example."""
        return replace(self, example=tuple(self._sizes(feeds).items()))

    def with_verified(self, feeds: Sequence[Any]) -> "Guard":
        """This guard, also accepting the point of ``feeds`` (the capture's own call, traced there)."""
        point = self.point(feeds)
        if point is None or point in self.verified:
            return self
        return replace(self, verified=self.verified + (point,))

    # ---------------------------------------------------------------------------------- the walk

    def _walk(self, feeds: Sequence[Any]) -> Iterator[Mismatch]:
        if len(feeds) != len(self.inputs):
            yield Mismatch("count", None, None, len(self.inputs), len(feeds))
            return
        broken = False
        for i, (rule, feed) in enumerate(zip(self.inputs, feeds)):
            problem = _input(rule, self._accept[i], self.device, feed)
            if problem is not None:
                broken = True
                yield problem
        if broken:  # sizes of a wrong rank or type cannot be compared further
            return
        sizes: dict[str, int] = {}
        for rule, feed in zip(self.inputs, feeds):
            if rule.shape is None:
                sizes[NUMBER_PREFIX + rule.name] = int(feed)
                continue
            for axis, (want, got) in enumerate(zip(rule.shape, feed.shape)):
                if type(want) is int:
                    if want != got:
                        yield Mismatch("size", rule.name, axis, want, got)
                elif sizes.setdefault(want, got) != got:
                    yield Mismatch("equal", rule.name, axis, f"dim '{want}' is {sizes[want]} elsewhere", got)
        yield from self._dims(sizes, feeds)

    def _dims(self, sizes: dict[str, int], feeds: Sequence[Any]) -> Iterator[Mismatch]:
        unusual = self._unusual(sizes)
        outcomes = self.outcomes(feeds)
        flipped = [i for i, ((_, expected), now) in enumerate(zip(self.conditions, outcomes)) if now != expected]
        if not unusual and not flipped:
            return
        involved = set(unusual)
        for i in flipped:
            involved |= self._reads[i]
        if (tuple(sorted((d, sizes[d]) for d in involved)), outcomes) in self._points:
            return  # traced and verified at this point
        for name, size in unusual.items():
            lo, hi = self._bounds.get(name, (0, None))
            kind = "range" if size < lo or (hi is not None and size > hi) else "special"
            yield Mismatch(kind, *_first(self.inputs, name), _interval(lo, hi) if kind == "range" else "verified", size)
        for i in flipped:
            tree, expected = self.conditions[i]
            now = "undefined (division by zero)" if outcomes[i] is None else outcomes[i]
            yield Mismatch("condition", None, None, expected, outcomes[i], f"{render(tree, self.names)} was "
                           f"{expected}, now {now}")

    def _unusual(self, sizes: dict[str, int]) -> dict[str, int]:
        """Dims whose size the graph was not traced for: outside their range, or below 2 in
        process and 0 shipped (see ``verify_small``)."""
        unusual = {}
        for name, size in sizes.items():
            if name.startswith(NUMBER_PREFIX):
                continue
            lo, hi = self._bounds.get(name, (0, None))
            if size < lo or (hi is not None and size > hi) or size < (SPECIAL_BELOW if self.verify_small else SHIPPED_BELOW):
                unusual[name] = size
        return unusual

    def bounds(self, dim: str) -> tuple[int, int | None]:
        """The size range the exporter assumed for a dim (``(0, None)``: any)."""
        return self._bounds.get(dim, (0, None))

    def _sizes(self, feeds: Sequence[Any]) -> dict[str, int]:
        """Each dim name's size in these feeds, and each lifted number's value (``#name``)."""
        sizes: dict[str, int] = {}
        for rule, feed in zip(self.inputs, feeds):
            if rule.shape is None:
                sizes[NUMBER_PREFIX + rule.name] = int(feed)
                continue
            for want, got in zip(rule.shape, feed.shape):
                if type(want) is not int:
                    sizes.setdefault(want, got)
        return sizes


def _fits(guard: Guard) -> Callable[[Sequence[Any]], bool]:
    """``guard.check(feeds) is None``, as fast as the guard allows: for the usual guard of static
    shapes on the CPU, a comparison of each tensor's shape, dtype and device, nothing else."""
    exact, check = guard._exact, guard.check
    if guard.device not in ("cpu", None):
        return lambda feeds: check(feeds) is None
    if exact is None:
        return _dynamic_fits(guard)
    cpu = guard.device == "cpu"
    if len(exact) == 1:  # one input, the most common call: no loop
        ((shape, accept),) = exact

        def fits_one(feeds: Sequence[Any]) -> bool:
            (feed,) = feeds
            return feed.shape == shape and feed.dtype in accept and (not cpu or feed.is_cpu)

        return fits_one

    def fits(feeds: Sequence[Any]) -> bool:
        if len(feeds) != len(exact):
            return False
        for feed, (shape, accept) in zip(feeds, exact):
            if feed.shape != shape or feed.dtype not in accept or (cpu and not feed.is_cpu):
                return False
        return True

    return fits


def _dynamic_fits(guard: Guard) -> Callable[[Sequence[Any]], bool]:
    """``fits`` of a guard with dynamic dims (a decoder step: its past length): the walk's
    decision for the usual call in plain loops (each input's dtype, device, rank and static sizes,
    each dim one size, every size inside its range, every condition as at capture), and the walk
    itself for anything else (lifted numbers, points verified outside, what to accept or refuse
    there). It returns True only where the walk finds no mismatch: ``_dims`` yields nothing when
    no size is unusual and no condition flipped."""
    check = guard.check
    if any(rule.shape is None for rule in guard.inputs):
        return lambda feeds: check(feeds) is None
    layout = tuple(
        (len(rule.shape), accept, tuple((a, d) for a, d in enumerate(rule.shape) if type(d) is int),
         tuple((a, d) for a, d in enumerate(rule.shape) if type(d) is not int))
        for rule, accept in zip(guard.inputs, guard._accept))
    smallest = SPECIAL_BELOW if guard.verify_small else SHIPPED_BELOW
    names = {d for rule in guard.inputs for d in rule.shape if type(d) is not int}
    bounds = tuple((name, max(guard.bounds(name)[0], smallest), guard.bounds(name)[1]) for name in sorted(names))
    expected = tuple(value for _, value in guard.conditions)
    cpu, count, outcomes = guard.device == "cpu", len(layout), guard.outcomes

    def usual(feeds: Sequence[Any]) -> bool:
        sizes: dict[str, int] = {}
        for feed, (rank, accept, fixed, named) in zip(feeds, layout):
            shape = feed.shape
            if len(shape) != rank or feed.dtype not in accept or (cpu and not feed.is_cpu):
                return False
            for axis, want in fixed:
                if shape[axis] != want:
                    return False
            for axis, name in named:
                if sizes.setdefault(name, shape[axis]) != shape[axis]:
                    return False
        for name, lo, hi in bounds:
            size = sizes[name]
            if size < lo or (hi is not None and size > hi):
                return False
        return not expected or outcomes(feeds) == expected

    def fits(feeds: Sequence[Any]) -> bool:
        try:
            if len(feeds) == count and usual(feeds):
                return True
        except AttributeError:  # not an array: the walk says what it is
            pass
        return check(feeds) is None

    return fits


def _input(rule: InputRule, accept: frozenset, device: str | None, feed: Any) -> Mismatch | None:
    """Why ``feed`` does not fit ``rule`` on its own (its type, dtype, device or rank), or ``None``."""
    if rule.shape is None:  # a lifted Python number (an int, or a 0-d integer array)
        if not _is_integer(feed):
            return Mismatch("type", rule.name, None, "a Python int", type(feed).__name__)
        lo, hi = rule.number or (None, None)
        if (lo is not None and feed < lo) or (hi is not None and feed > hi):
            return Mismatch("number", rule.name, None, _interval(lo, hi), int(feed))
        return None
    dtype = getattr(feed, "dtype", None)
    if dtype is None or not hasattr(feed, "shape"):
        return Mismatch("type", rule.name, None, f"an array of {rule.dtype}", type(feed).__name__)
    if dtype not in accept and dtype_name(dtype) != rule.dtype:
        return Mismatch("dtype", rule.name, None, rule.dtype, dtype_name(dtype))
    if not getattr(dtype, "isnative", True):  # numpy's '>f4' is named float32, yet onnxruntime misreads it
        return Mismatch("byteorder", rule.name, None, f"{rule.dtype} in {sys.byteorder}-endian byte order", dtype.str)
    if device is not None and str(getattr(feed, "device", "cpu")) != device:
        return Mismatch("device", rule.name, None, device, str(getattr(feed, "device", "cpu")))
    if len(feed.shape) != len(rule.shape):
        dims = ", ".join(map(str, rule.shape))
        return Mismatch("rank", rule.name, None, f"{len(rule.shape)} [{dims}]", tuple(feed.shape))
    return None


def _first(inputs: Sequence[InputRule], dim: str) -> tuple[str | None, int | None]:
    """The first input and axis that carry a dim name."""
    for rule in inputs:
        if rule.shape is not None and dim in rule.shape:
            return rule.name, rule.shape.index(dim)
    return None, None


def _dims_read(inputs: Sequence[InputRule], tree: Sequence[Any]) -> frozenset[str]:
    """The dim names a condition tree reads (static axes read none; a lifted number reads its
    value, named ``#name``, which pins a verified point like a size)."""
    if tree[0] == "size":
        shape = inputs[tree[1]].shape
        dim = shape[tree[2]] if shape is not None else None
        return frozenset([dim]) if isinstance(dim, str) else frozenset()
    if tree[0] == "num":
        return frozenset([NUMBER_PREFIX + inputs[tree[1]].name])
    if tree[0] == "const":
        return frozenset()
    return frozenset().union(*(_dims_read(inputs, child) for child in tree[1:]))


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return getattr(value, "shape", None) == () and "int" in str(getattr(value, "dtype", ""))


def _interval(lo: int | None, hi: int | None) -> str:
    return f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` / ``numpy.dtype('float32')`` -> ``"float32"``."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    return str(dtype).replace("torch.", "")


def _dtype_objects(name: str) -> frozenset:
    """The dtype objects of a dtype name: numpy's and, when torch is imported, torch's."""
    found: set[Any] = set()
    try:
        found.add(np.dtype(name))
    except TypeError:  # bfloat16: numpy has no such type
        pass
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, name, None), torch.dtype):
        found.add(getattr(torch, name))
    return frozenset(found)
