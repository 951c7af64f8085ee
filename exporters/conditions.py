"""Shape conditions the exporter traced through but did not keep.

torch.export evaluates Python branches on sizes (``if x.shape[0] == 4:``) at trace time and, for
dynamic dims, may leave no runtime check behind: the exported program only holds the dead
comparison nodes. A graph served for sizes that flip such a comparison would take the wrong
branch silently. These helpers turn each dead comparison into data: an expression tree over input
sizes and lifted numbers. The caller records each tree's value at capture and re-evaluates it.

Tree nodes: ``("size", input, axis)``, ``("num", input)``, ``("const", value)``,
``(op, child, ...)`` with ``op`` one of the names in ``OP_NAMES`` (what each means, and how it is
evaluated and rendered, is defined by the consumer of the trees: clika_runtime's guard).
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

_TARGETS = {
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge", operator.add: "add", operator.sub: "sub", operator.mul: "mul",
    operator.floordiv: "floordiv", operator.mod: "mod", operator.neg: "neg", torch.sym_not: "not",
    operator.and_: "and", operator.or_: "or", torch.sym_max: "max", torch.sym_min: "min",
}
OP_NAMES = frozenset(_TARGETS.values())
_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "not", "and", "or"}


class Opaque(Exception):
    """A condition built from an operation outside ``OP_NAMES``."""


def leaves_of(tree: tuple) -> set[tuple[int, int | None]]:
    """The (input, axis) pairs a tree reads (axis ``None`` for a lifted number)."""
    if tree[0] == "size":
        return {(tree[1], tree[2])}
    if tree[0] == "num":
        return {(tree[1], None)}
    if tree[0] == "const":
        return set()
    return set().union(*(leaves_of(child) for child in tree[1:]))


def dead_conditions(program: Any) -> tuple[list[tuple], set[tuple[int, int | None]]]:
    """Trees of the dead comparisons in an exported program, and the inputs of any it cannot express.

    Returns ``(trees, opaque)``: ``opaque`` holds (input, axis) pairs read by conditions that use
    operations outside ``OP_NAMES``; the caller must keep those static.
    """
    user = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    index = {name: i for i, name in enumerate(user)}
    trees, opaque = [], set()
    for node in program.graph.nodes:
        if node.op != "call_function" or node.users or _TARGETS.get(node.target) not in _COMPARISONS:
            continue
        try:
            trees.append(_tree(node, index))
        except Opaque:
            opaque |= _reads(node, index)
    return trees, opaque


# sympy's and torch's expression classes, by name (torch's live in a private module), as tree ops.
_EXPRESSIONS = {"Add": "add", "Mul": "mul", "FloorDiv": "floordiv", "PythonMod": "mod", "Mod": "mod",
                "Max": "max", "Min": "min"}


def derived_dims(program: Any) -> dict[tuple[int, int], tuple]:
    """Input dims the exporter wrote as expressions of other inputs' dims (a mask one longer than
    the past: ``s27 + 1``), each as the condition ``("eq", size, expression)`` that holds at
    capture. A dim whose expression reads a symbol no input carries alone, or an operation
    outside ``OP_NAMES``, is left out: the caller keeps it static."""
    user = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    index = {name: i for i, name in enumerate(user)}
    shapes = {index[n.name]: n.meta["val"].shape for n in program.graph.nodes
              if n.op == "placeholder" and n.name in index and isinstance(n.meta.get("val"), torch.Tensor)}
    alone: dict[Any, tuple] = {}  # symbol -> the first (input, axis) whose dim is that symbol alone
    for i, shape in sorted(shapes.items()):
        for axis, size in enumerate(shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                alone.setdefault(size.node.expr, ("size", i, axis))
    derived = {}
    for i, shape in shapes.items():
        for axis, size in enumerate(shape):
            if not isinstance(size, torch.SymInt) or size.node.expr.is_Symbol:
                continue
            try:
                derived[(i, axis)] = ("eq", ("size", i, axis), _expression(size.node.expr, alone))
            except Opaque:
                pass
    return derived


def _expression(expr: Any, alone: dict[Any, tuple]) -> tuple:
    if expr.is_Integer:
        return ("const", int(expr))
    if expr.is_Symbol:
        if expr not in alone:
            raise Opaque(expr)
        return alone[expr]
    name = _EXPRESSIONS.get(type(expr).__name__)
    if name is None or not expr.args:
        raise Opaque(expr)
    children = [_expression(arg, alone) for arg in expr.args]
    if name in ("max", "min"):
        return (name, *children)
    tree = children[0]
    for child in children[1:]:  # sympy's n-ary sums and products as binary ones
        tree = (name, tree, child)
    return tree


def _tree(node: Any, index: dict[str, int]) -> tuple:
    if not isinstance(node, torch.fx.Node):
        if isinstance(node, (bool, int)):
            return ("const", node)
        raise Opaque(node)
    if node.op == "placeholder" and node.name in index:
        return ("num", index[node.name])
    if node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
        source, axis = node.args
        if source.op == "placeholder" and source.name in index:
            return ("size", index[source.name], int(axis))
        raise Opaque(node)
    name = _TARGETS.get(node.target) if node.op == "call_function" else None
    if name is None or node.kwargs:
        raise Opaque(node)
    return (name, *(_tree(arg, index) for arg in node.args))


def _reads(node: Any, index: dict[str, int]) -> set[tuple[int, int | None]]:
    found: set[tuple[int, int | None]] = set()
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if not isinstance(current, torch.fx.Node) or current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and current.name in index:
            found.add((index[current.name], None))
        elif current.op == "call_function" and current.target is torch.ops.aten.sym_size.int:
            source, axis = current.args
            if source.name in index:
                found.add((index[source.name], int(axis)))
        else:
            stack.extend(a for a in current.args if isinstance(a, torch.fx.Node))
    return found


def relevant(trees: Sequence[tuple], dynamic: set[tuple[int, int | None]]) -> list[tuple]:
    """The trees that read at least one dynamic size or lifted number (others cannot change)."""
    return [t for t in trees if leaves_of(t) & dynamic]
