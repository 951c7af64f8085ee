"""The guard: everything a graph assumes of the inputs it serves, as data, checked in one place.

A ``Guard`` holds, per graph input, its dtype and shape (an int where static, a dim name where
dynamic; one name means one size), the size range the exporter assumed for each dim, the value
range of each lifted Python number, the size conditions the trace branched on (with the value
each had at capture), and the sizes 0 and 1 that were verified against eager. ``check(feeds)``
returns the first ``Mismatch`` (or ``None``) and serves both to decide and to explain. The same
guard ships in a graph's metadata as JSON (``to_json`` / ``from_json``) and ``cr.load`` enforces it.

No torch at module level: a loaded graph is guarded on a box with only onnxruntime and numpy.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

GUARD_VERSION = 1

# The size-condition language: op name -> (evaluation, how it reads). The exporter maps FX
# targets to these names (exporters/conditions.py); this table is the only place they mean anything.
OPS: dict[str, tuple[Any, str]] = {
    "eq": (operator.eq, "=="), "ne": (operator.ne, "!="), "lt": (operator.lt, "<"), "le": (operator.le, "<="),
    "gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "add": (operator.add, "+"), "sub": (operator.sub, "-"),
    "mul": (operator.mul, "*"), "floordiv": (operator.floordiv, "//"), "mod": (operator.mod, "%"),
    "and": (operator.and_, "and"), "or": (operator.or_, "or"), "neg": (operator.neg, "-"),
    "not": (operator.not_, "not"), "max": (max, "max"), "min": (min, "min"),
}
_INFIX = {"eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "floordiv", "mod", "and", "or"}
# Sizes 0 and 1 are where tracers assume most (broadcasting, 0/1 specialisation): a graph serves a
# dynamic dim at these sizes only once a call at that size was verified against eager.
SPECIAL_BELOW = 2


def evaluate(tree: Sequence[Any], feeds: Sequence[Any]) -> Any:
    """The value of a condition tree for these feeds. Leaves: ``("size", input, axis)``,
    ``("num", input)`` (a lifted number), ``("const", value)``."""
    kind = tree[0]
    if kind == "size":
        return feeds[tree[1]].shape[tree[2]]
    if kind == "num":
        return int(feeds[tree[1]])
    if kind == "const":
        return tree[1]
    return OPS[kind][0](*(evaluate(child, feeds) for child in tree[1:]))


def render(tree: Sequence[Any], names: Sequence[str]) -> str:
    """A condition tree as text: ``x.shape[0] == 4``."""
    kind = tree[0]
    if kind == "size":
        return f"{names[tree[1]]}.shape[{tree[2]}]"
    if kind == "num":
        return names[tree[1]]
    if kind == "const":
        return repr(tree[1])
    parts = [render(child, names) for child in tree[1:]]
    symbol = OPS[kind][1]
    if kind in _INFIX and len(parts) == 2:
        return f"{parts[0]} {symbol} {parts[1]}"
    if kind in ("neg", "not"):
        return f"{symbol} ({parts[0]})" if kind == "not" else f"-({parts[0]})"
    return f"{symbol}({', '.join(parts)})"


@dataclass(frozen=True)
class InputRule:
    """What one graph input must be: ``shape`` entries are ints (static) or dim names (dynamic);
    ``shape`` is ``None`` for a lifted Python number, whose value must lie in ``number``."""

    name: str
    dtype: str  # as numpy and torch spell it: "float32", "int64", "bfloat16"
    shape: tuple[int | str, ...] | None
    number: tuple[int, int | None] | None = None


@dataclass(frozen=True)
class Special:
    """Sizes below 2 verified against eager: dims at exactly these sizes, with the conditions
    evaluating to ``outcomes``, are served by this graph."""

    sizes: tuple[tuple[str, int], ...]
    outcomes: tuple[Any, ...]


@dataclass(frozen=True)
class Mismatch:
    """Why a guard refuses a call: ``kind`` is one of ``count``, ``type``, ``dtype``, ``device``,
    ``rank``, ``size`` (a static axis), ``equal`` (dims sharing a name differ), ``range``,
    ``number``, ``condition`` (a size branch flipped) or ``special`` (sizes 0/1 not yet verified)."""

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
            "rank": f"{where}: expected rank {self.expected}, got shape {self.got}",
            "size": f"{where}: expected size {self.expected}, got {self.got}",
            "equal": f"{where}: size {self.got}, but {self.expected} (the graph requires them equal)",
            "range": f"{where}: size {self.got} outside the graph's range {self.expected}",
            "number": f"{where} = {self.got}: outside the graph's range {self.expected}",
            "condition": f"a size condition the graph was traced under changed: {self.detail}",
            "special": f"{where}: size {self.got} not yet verified for this graph{self.detail}",
        }[self.kind]
        return text


@dataclass(frozen=True)
class Guard:
    """What a graph assumes of its inputs (see the module docstring).

    ``device`` and ``verify_small`` are the in-process part, not shipped: the device fed tensors
    must be on, and whether a dynamic dim at size 0 or 1 needs a verified ``Special`` even inside
    its range (in process, one eager call verifies it; a shipped graph has no eager to ask, and
    serves what its ranges and specials say).
    """

    inputs: tuple[InputRule, ...]
    ranges: tuple[tuple[str, int, int | None], ...] = ()  # dim name, lowest, highest (None: unbounded)
    conditions: tuple[tuple[tuple, Any], ...] = ()  # (tree, value at capture)
    specials: tuple[Special, ...] = ()
    device: str | None = None
    verify_small: bool = False
    # Lookups derived from the fields above, built once; they decide nothing the fields do not say.
    _accept: tuple[frozenset, ...] = field(init=False, repr=False, compare=False)
    _exact: tuple | None = field(init=False, repr=False, compare=False)
    _bounds: dict[str, tuple[int, int | None]] = field(init=False, repr=False, compare=False)
    _verified: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        accept = tuple(_dtype_objects(rule.dtype) for rule in self.inputs)
        object.__setattr__(self, "_accept", accept)
        object.__setattr__(self, "_bounds", {name: (lo, hi) for name, lo, hi in self.ranges})
        object.__setattr__(self, "_verified", frozenset((s.sizes, s.outcomes) for s in self.specials))
        static = all(r.shape is not None and all(type(d) is int for d in r.shape) for r in self.inputs)
        exact = None
        if static and not self.conditions:
            exact = tuple((tuple(r.shape), a) for r, a in zip(self.inputs, accept))
        object.__setattr__(self, "_exact", exact)

    @property
    def names(self) -> list[str]:
        """The graph input names, in order."""
        return [rule.name for rule in self.inputs]

    @property
    def exact_shapes(self) -> tuple[tuple[int, ...], ...] | None:
        """Every input's one accepted shape, when the guard is nothing more than that."""
        return None if self._exact is None else tuple(shape for shape, _ in self._exact)

    def check(self, feeds: Sequence[Any]) -> Mismatch | None:
        """The first reason this graph may not serve ``feeds`` (tensors or arrays, and Python
        numbers for lifted inputs), or ``None`` when it may."""
        exact = self._exact
        if exact is not None and len(feeds) == len(exact) and self._on_device(feeds):
            for feed, (shape, accept) in zip(feeds, exact):
                if feed.shape != shape or feed.dtype not in accept:
                    break
            else:
                return None
        return next(self._walk(feeds), None)

    def mismatches(self, feeds: Sequence[Any]) -> list[Mismatch]:
        """Every reason this graph may not serve ``feeds`` (empty when it may)."""
        return list(self._walk(feeds))

    def outcomes(self, feeds: Sequence[Any]) -> tuple[Any, ...]:
        """Each size condition's value for these feeds."""
        return tuple(evaluate(tree, feeds) for tree, _ in self.conditions)

    def special_sizes(self, feeds: Sequence[Any]) -> tuple[tuple[str, int], ...]:
        """The dynamic dims of these feeds at sizes below 2 that need a verified ``Special``, as
        (dim name, size), sorted."""
        sizes = self._sizes(feeds)
        return tuple(sorted(
            (name, size) for name, size in sizes.items()
            if size < SPECIAL_BELOW and (self.verify_small or size < self._bounds.get(name, (0, None))[0])
        ))

    def with_special(self, feeds: Sequence[Any]) -> "Guard":
        """This guard, also accepting the special sizes of ``feeds`` (verified by the caller)."""
        special = Special(self.special_sizes(feeds), self.outcomes(feeds))
        if not special.sizes or special in self.specials:
            return self
        return replace(self, specials=self.specials + (special,))

    # ---------------------------------------------------------------------------------- the walk

    def _walk(self, feeds: Sequence[Any]) -> Iterator[Mismatch]:
        if len(feeds) != len(self.inputs):
            yield Mismatch("count", None, None, len(self.inputs), len(feeds))
            return
        broken = False
        for i, (rule, feed) in enumerate(zip(self.inputs, feeds)):
            problem = self._input(i, rule, feed)
            if problem is not None:
                broken = True
                yield problem
        if broken:  # sizes of a wrong rank or type cannot be compared further
            return
        sizes: dict[str, int] = {}
        for rule, feed in zip(self.inputs, feeds):
            if rule.shape is None:
                continue
            for axis, (want, got) in enumerate(zip(rule.shape, feed.shape)):
                if type(want) is int:
                    if want != got:
                        yield Mismatch("size", rule.name, axis, want, got)
                elif sizes.setdefault(want, got) != got:
                    yield Mismatch("equal", rule.name, axis, f"dim '{want}' is {sizes[want]} elsewhere", got)
        yield from self._dims(sizes, feeds)

    def _input(self, i: int, rule: InputRule, feed: Any) -> Mismatch | None:
        if rule.shape is None:  # a lifted Python number
            if isinstance(feed, bool) or not isinstance(feed, (int, np.integer)):
                return Mismatch("type", rule.name, None, "a Python int", type(feed).__name__)
            lo, hi = rule.number or (None, None)
            if (lo is not None and feed < lo) or (hi is not None and feed > hi):
                return Mismatch("number", rule.name, None, _interval(lo, hi), int(feed))
            return None
        dtype = getattr(feed, "dtype", None)
        if dtype is None or not hasattr(feed, "shape"):
            return Mismatch("type", rule.name, None, f"an array of {rule.dtype}", type(feed).__name__)
        if dtype not in self._accept[i] and dtype_name(dtype) != rule.dtype:
            return Mismatch("dtype", rule.name, None, rule.dtype, dtype_name(dtype))
        if self.device is not None and str(getattr(feed, "device", "cpu")) != self.device:
            return Mismatch("device", rule.name, None, self.device, str(getattr(feed, "device", "cpu")))
        if len(feed.shape) != len(rule.shape):
            dims = ", ".join(map(str, rule.shape))
            return Mismatch("rank", rule.name, None, f"{len(rule.shape)} [{dims}]", tuple(feed.shape))
        return None

    def _dims(self, sizes: dict[str, int], feeds: Sequence[Any]) -> Iterator[Mismatch]:
        special = []
        for name, size in sizes.items():
            lo, hi = self._bounds.get(name, (0, None))
            if size < SPECIAL_BELOW and (self.verify_small or size < lo):
                special.append((name, size))
            elif size < lo or (hi is not None and size > hi):
                yield Mismatch("range", *self._first(name), _interval(lo, hi), size)
        outcomes = self.outcomes(feeds)
        if not special:
            for (tree, expected), now in zip(self.conditions, outcomes):
                if now != expected:
                    text = f"{render(tree, self.names)} was {expected}, now {now}"
                    yield Mismatch("condition", None, None, expected, now, text)
            return
        key = (tuple(sorted(special)), outcomes)
        if key not in self._verified:
            name, size = key[0][0]
            flipped = [render(t, self.names) for (t, e), now in zip(self.conditions, outcomes) if now != e]
            detail = f" (and the conditions {flipped} flip there)" if flipped else ""
            yield Mismatch("special", *self._first(name), "verified sizes", size, detail)

    def _first(self, dim: str) -> tuple[str | None, int | None]:
        """The first input and axis that carry a dim name."""
        for rule in self.inputs:
            if rule.shape is not None and dim in rule.shape:
                return rule.name, rule.shape.index(dim)
        return None, None

    def _sizes(self, feeds: Sequence[Any]) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for rule, feed in zip(self.inputs, feeds):
            if rule.shape is not None:
                for want, got in zip(rule.shape, feed.shape):
                    if type(want) is not int:
                        sizes.setdefault(want, got)
        return sizes

    def _on_device(self, feeds: Sequence[Any]) -> bool:
        device = self.device
        if device is None:
            return True
        if device == "cpu":
            return all(getattr(f, "is_cpu", False) for f in feeds)
        return all(str(getattr(f, "device", "")) == device for f in feeds)

    # ----------------------------------------------------------------------------- shipped form

    def to_json(self) -> dict[str, Any]:
        """The versioned JSON form that ships in a graph's metadata (no device: any place)."""
        return {
            "version": GUARD_VERSION,
            "inputs": [_rule_json(r) for r in self.inputs],
            "ranges": {name: [lo, hi] for name, lo, hi in self.ranges},
            "conditions": [{"when": _tree_json(t), "is": v} for t, v in self.conditions],
            "specials": [{"sizes": dict(s.sizes), "outcomes": list(s.outcomes)} for s in self.specials],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Guard":
        """Parse the shipped form; ``ValueError`` naming what is malformed."""
        if not isinstance(data, Mapping) or data.get("version") != GUARD_VERSION:
            version = data.get("version") if isinstance(data, Mapping) else None
            raise ValueError(f"guard: unknown version {version!r} (this clika_runtime reads version {GUARD_VERSION})")
        try:
            inputs = tuple(_rule_from(r) for r in data["inputs"])
            ranges = tuple((str(n), int(lo), None if hi is None else int(hi)) for n, (lo, hi) in data.get("ranges", {}).items())
            conditions = tuple((_tree_from(c["when"], len(inputs)), _scalar(c["is"])) for c in data.get("conditions", []))
            specials = tuple(
                Special(tuple(sorted((str(k), int(v)) for k, v in s["sizes"].items())), tuple(map(_scalar, s["outcomes"])))
                for s in data.get("specials", [])
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"guard: malformed ({type(e).__name__}: {e})") from None
        return cls(inputs, ranges, conditions, specials)


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


def _rule_json(rule: InputRule) -> dict[str, Any]:
    if rule.shape is None:
        return {"name": rule.name, "dtype": rule.dtype, "number": list(rule.number or (None, None))}
    return {"name": rule.name, "dtype": rule.dtype, "shape": list(rule.shape)}


def _rule_from(data: Mapping[str, Any]) -> InputRule:
    name, dtype = str(data["name"]), str(data["dtype"])
    if "number" in data:
        lo, hi = data["number"]
        return InputRule(name, dtype, None, (None if lo is None else int(lo), None if hi is None else int(hi)))
    shape = tuple(d if isinstance(d, str) else int(d) for d in data["shape"])
    return InputRule(name, dtype, shape)


def _tree_json(tree: Sequence[Any]) -> list[Any]:
    if tree[0] in ("size", "num", "const"):
        return list(tree)
    return [tree[0], *(_tree_json(child) for child in tree[1:])]


def _tree_from(data: Any, n_inputs: int, depth: int = 0) -> tuple:
    """A condition tree from JSON, checked: known ops, inputs in range, bounded depth."""
    if not isinstance(data, list) or not data or depth > 32:
        raise ValueError(f"condition: expected a non-empty list, got {str(data)[:40]!r}")
    kind = data[0]
    if kind == "size" and len(data) == 3 and 0 <= int(data[1]) < n_inputs:
        return ("size", int(data[1]), int(data[2]))
    if kind == "num" and len(data) == 2 and 0 <= int(data[1]) < n_inputs:
        return ("num", int(data[1]))
    if kind == "const" and len(data) == 2:
        return ("const", _scalar(data[1]))
    if kind in OPS and len(data) >= 2:
        return (kind, *(_tree_from(child, n_inputs, depth + 1) for child in data[1:]))
    raise ValueError(f"condition: unknown node {str(data)[:40]!r}")


def _scalar(value: Any) -> Any:
    if isinstance(value, (bool, int)):
        return value
    raise ValueError(f"expected an int or bool, got {value!r}")
