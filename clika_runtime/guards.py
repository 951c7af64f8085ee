"""The cache key and the shape guard: plain tuples compared with ``==``, computed in one place.

Key: (input structure, static leaf values, each fed leaf's dtype/rank/device[, shapes], training).
Guard: a capture's static sizes, the axes its graph requires equal, and the size ranges it assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import copysign
from typing import Any, Sequence

import torch

from exporters.conditions import evaluate

_NAN = ("nan",)
_Tensor = torch.Tensor  # NaN != NaN would make every call with a NaN static leaf miss


def key_parts(
    leaves: Sequence[Any], lifted: frozenset[int], with_shapes: bool
) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...], bool]:
    """One pass over a call's leaves: what the graph is fed, and what of the call joins the key.

    Returns the fed leaves (tensors, lifted numbers), the static part of the key (type and value of
    every other leaf; only the type of a lifted number), each fed tensor's dtype/rank/device (and
    shape when ``with_shapes``), and whether any fed tensor requires grad.
    """
    feeds = []
    statics = []
    metas = []
    grad = False
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor):
            feeds.append(leaf)
            metas.append((leaf.dtype, leaf.ndim, leaf.device, leaf.shape) if with_shapes else (leaf.dtype, leaf.ndim, leaf.device))
            grad = grad or leaf.requires_grad
            continue
        kind = type(leaf)
        if lifted and i in lifted:
            feeds.append(leaf)
            statics.append(kind)
        elif kind is float:  # NaN != NaN would miss every time; -0.0 == 0.0 but 1/-0.0 != 1/0.0
            statics.append((kind, leaf, copysign(1.0, leaf)) if leaf == leaf else (kind, _NAN))
        else:  # type joins the value: 1, 1.0 and True hash alike but must not share a capture
            statics.append((kind, leaf))
    return feeds, tuple(statics), tuple(metas), grad


@dataclass(frozen=True)
class ShapeGuard:
    """What a captured graph assumes of its input shapes.

    ``dims[i]`` is input i's dims: int (static) or a dim name (dynamic; one name = one size).
    ``ranges`` holds the sizes the exporter assumed for a dim name, where that is not [0, inf);
    ``numbers`` the values it assumed for lifted Python-number inputs, by input index;
    ``conditions`` the size conditions the trace branched on, with their value at capture
    (``exporters.conditions`` trees): a call that flips one must not be served by this graph.
    """

    dims: tuple[tuple[int | str | None, ...] | None, ...]
    ranges: tuple[tuple[str, int, int | None], ...] = ()
    numbers: tuple[tuple[int, int, int | None], ...] = ()
    conditions: tuple[tuple[tuple, Any], ...] = ()

    def __post_init__(self) -> None:
        statics, exact, positions = [], [], {}
        for i, dims in enumerate(self.dims):
            if dims is None:  # a lifted number: no shape
                continue
            if all(isinstance(d, int) for d in dims):
                exact.append((i, torch.Size(dims)))
                continue
            for axis, d in enumerate(dims):
                if isinstance(d, int):
                    statics.append((i, axis, d))
                elif d is not None:
                    positions.setdefault(d, []).append((i, axis))
        object.__setattr__(self, "_exact", tuple(exact))
        object.__setattr__(self, "_statics", tuple(statics))
        object.__setattr__(self, "_groups", tuple(tuple(p) for p in positions.values() if len(p) > 1))
        bounds = {name: (lo, hi) for name, lo, hi in self.ranges}
        object.__setattr__(
            self, "_bounds", tuple((positions[n][0], lo, hi) for n, (lo, hi) in bounds.items() if n in positions)
        )

    @property
    def exact_shapes(self) -> tuple[torch.Size, ...] | None:
        """Every input's one accepted shape, when the guard is nothing more than that."""
        if len(self._exact) != len(self.dims) or self.numbers or self.conditions:
            return None
        return tuple(shape for _, shape in self._exact)

    def matches(self, feeds: Sequence[Any], conditions: bool = True) -> bool:
        """True when the graph may serve these inputs (size conditions skipped if ``conditions`` is False)."""
        for i, shape in self._exact:
            if feeds[i].shape != shape:
                return False
        for i, axis, size in self._statics:
            if feeds[i].shape[axis] != size:
                return False
        for group in self._groups:
            (i, a), *rest = group
            size = feeds[i].shape[a]
            for j, b in rest:
                if feeds[j].shape[b] != size:
                    return False
        for (i, a), lo, hi in self._bounds:
            size = feeds[i].shape[a]
            if size < lo or (hi is not None and size > hi):
                return False
        for i, lo, hi in self.numbers:
            if feeds[i] < lo or (hi is not None and feeds[i] > hi):
                return False
        if conditions and self.conditions:
            sizes = _sizes(feeds)
            for tree, expected in self.conditions:
                if evaluate(tree, sizes) != expected:
                    return False
        return True

    def drift(self, feeds: Sequence[Any], names: Sequence[str]) -> tuple[list[set[int]], list[str]]:
        """Axes that must become dynamic for these inputs, and the reasons in words."""
        axes: list[set[int]] = [set() for _ in feeds]
        reasons = []
        for i, dims in enumerate(self.dims):
            if dims is None:
                continue
            for axis, d in enumerate(dims):
                size = feeds[i].shape[axis]
                if isinstance(d, int) and size != d:
                    axes[i].add(axis)
                    reasons.append(f"shape drift: input '{names[i]}' axis {axis}: {d} -> {size}")
        for group in self._groups:
            (i, a), *rest = group
            for j, b in rest:
                if feeds[j].shape[b] != feeds[i].shape[a]:
                    reasons.append(
                        f"shape drift: input '{names[i]}' axis {a} ({feeds[i].shape[a]}) and input '{names[j]}' "
                        f"axis {b} ({feeds[j].shape[b]}) differ, the graph assumed them equal"
                    )
        for (i, a), lo, hi in self._bounds:
            size = feeds[i].shape[a]
            if size < lo or (hi is not None and size > hi):
                reasons.append(
                    f"shape drift: input '{names[i]}' axis {a} size {size} outside the graph's range [{lo}, {hi or 'inf'}]"
                )
        for i, lo, hi in self.numbers:
            if feeds[i] < lo or (hi is not None and feeds[i] > hi):
                reasons.append(f"input '{names[i]}' = {feeds[i]} outside the graph's range [{lo}, {hi or 'inf'}]")
        sizes = _sizes(feeds)
        for tree, expected in self.conditions:
            if evaluate(tree, sizes) != expected:
                reasons.append(f"shape condition the graph was traced under changed: {render(tree, names)} "
                               f"was {expected}, now {evaluate(tree, sizes)}")
        return axes, reasons


def _sizes(feeds: Sequence[Any]) -> Any:
    return lambda i, axis: feeds[i] if axis is None else feeds[i].shape[axis]


_SYMBOLS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "add": "+", "sub": "-",
            "mul": "*", "floordiv": "//", "mod": "%", "and": "and", "or": "or"}


def render(tree: tuple, names: Sequence[str]) -> str:
    """A condition tree as text: ``x.shape[0] == 4``."""
    kind = tree[0]
    if kind == "size":
        return f"{names[tree[1]]}.shape[{tree[2]}]"
    if kind == "num":
        return names[tree[1]]
    if kind == "const":
        return repr(tree[1])
    parts = [render(child, names) for child in tree[1:]]
    if kind in _SYMBOLS and len(parts) == 2:
        return f"({parts[0]} {_SYMBOLS[kind]} {parts[1]})" if kind not in ("eq", "ne", "lt", "le", "gt", "ge") else f"{parts[0]} {_SYMBOLS[kind]} {parts[1]}"
    return f"{kind}({', '.join(parts)})"


def describe_key_change(old: tuple, new: tuple, static_names: Sequence[str], tensor_names: Sequence[str]) -> str:
    """Why ``new`` missed the cache, in words, by diffing it against the closest previous key."""
    old_spec, old_statics, old_meta, old_training = old
    new_spec, new_statics, new_meta, new_training = new
    if old_spec != new_spec:
        return f"new structure: {_short(old_spec)} -> {_short(new_spec)}"
    if old_training != new_training:
        return f"module training flag changed: {old_training} -> {new_training}"
    for name, a, b in zip(static_names, old_statics, new_statics):
        if a != b:
            return f"static value changed: '{name}' {_value(a)} -> {_value(b)}"
    for name, a, b in zip(tensor_names, old_meta, new_meta):
        if a != b:
            return f"input '{name}' changed: {_meta(a)} -> {_meta(b)}"
    return "new key"


def _short(spec: Any) -> str:
    text = str(spec).replace(", NoneIsLeaf", "").replace(", namespace='clika_runtime'", "")
    return text if len(text) < 120 else text[:117] + "..."


def _value(static: Any) -> str:
    if isinstance(static, tuple):
        value = static[1]
        return f"{value!r}" if value is not _NAN else "nan"
    return f"<{getattr(static, '__name__', static)} graph input>"


def _meta(meta: Any) -> str:
    dtype, rank, device, *shape = meta
    text = f"{str(dtype).replace('torch.', '')} rank {rank} on {device}"
    return text + (f" shape {tuple(shape[0])}" if shape else "")
