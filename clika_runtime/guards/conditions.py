"""The size-condition language: trees of ops over input sizes and lifted numbers, evaluated and
rendered here and nowhere else.

A tree is ``("size", input, axis)``, ``("num", input)`` (a lifted number), ``("const", value)``
or ``(op, child, ...)`` with ``op`` a name of ``OPS``. The exporter maps FX targets to these names
(exporters/conditions.py); the guard records each tree with its value at capture and evaluates it
again on every call it checks.

No torch: a loaded graph's conditions are evaluated on a box with only onnxruntime and numpy.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

# op name -> (evaluation, how it reads): the only place the names mean anything.
OPS: dict[str, tuple[Any, str]] = {
    "eq": (operator.eq, "=="), "ne": (operator.ne, "!="), "lt": (operator.lt, "<"), "le": (operator.le, "<="),
    "gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "add": (operator.add, "+"), "sub": (operator.sub, "-"),
    "mul": (operator.mul, "*"), "floordiv": (operator.floordiv, "//"), "mod": (operator.mod, "%"),
    "and": (operator.and_, "and"), "or": (operator.or_, "or"), "neg": (operator.neg, "-"),
    "not": (operator.not_, "not"), "max": (max, "max"), "min": (min, "min"),
}
ARITY = {"neg": (1, 1), "not": (1, 1), "max": (2, 64), "min": (2, 64)}  # (fewest, most); the others take 2
_INFIX = {"eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "floordiv", "mod", "and", "or"}


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


def defined(tree: Sequence[Any], feeds: Sequence[Any]) -> Any:
    """``evaluate``, but ``None`` where the tree divides by zero."""
    try:
        return evaluate(tree, feeds)
    except ZeroDivisionError:  # a size that is 0 now divides: undefined, so never the value at capture
        return None


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
