"""The graph's guard written into the model Triton serves.

Triton reads only the config: a dynamic dim is ``-1``, any size. The guard a capture recorded
(dims that must be equal, the exporter's ranges, the size conditions the trace branched on, the
range of a lifted number, no size 0 on a dynamic dim: ``guard.SHIPPED_BELOW``) would go unchecked, and a request outside it would be served the side of
a branch its sizes do not take (``x * 2 if x.shape[1] % 4 == 0 else x * 3``, captured at widths 8
and 12, asked at 10). So the written model computes the guard from its inputs' shapes, in a few
int64 ops on one-element tensors, ending in a node named after the guard that fails unless it
holds (a Reshape to ``[-2]``), and the model reads every input through a Reshape to its own shape
that waits for that node: the same tensor when the guard holds (onnxruntime's Reshape aliases
it), onnxruntime's error naming the guard when it does not. Python's semantics are kept: floor
division and modulo round toward minus infinity, and a zero divisor makes a condition undefined
(false), never a division the backend runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import onnx
from onnx import TensorProto, helper

from clika_runtime.guards.conditions import render
from clika_runtime.guards.guard import NUMBER_PREFIX, SHIPPED_BELOW, Guard

PREFIX = "clika_runtime.guard"  # names of what this module adds: checker.py looks for it
_COMPARE = {"eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual"}
_ARITHMETIC = {"add": "Add", "sub": "Sub", "mul": "Mul", "max": "Max", "min": "Min", "and": "And", "or": "Or"}
_NAME_CHARS = 400  # of the guard's text in the failing node's name (onnxruntime's error quotes it)


def enforced(model_proto: Any, guard: Guard) -> Any:
    """A copy of ``model_proto`` that fails, naming ``guard``, on inputs the guard refuses; the
    model itself when the guard asks nothing Triton's config does not (static dims only)."""
    builder = _Builder(guard)
    ok = builder.holds()
    if ok is None:
        return model_proto
    proto = onnx.ModelProto()
    proto.CopyFrom(model_proto)
    text = f"{PREFIX}: the request's sizes are outside what the graph was traced for ({words(guard)})"
    passed = builder.failing_unless(ok, text[:_NAME_CHARS])
    # Every input reaches the model through the guard: a request outside it fails on the guard's
    # error, not on a broadcast deep inside that its sizes break first, nor with an answer.
    gates = _gated_inputs(proto.graph, builder.names, passed)
    nodes = builder.nodes + gates + list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return proto


def words(guard: Guard) -> str:
    """What ``guard`` asks beyond static dims, in words (for the error onnxruntime raises)."""
    names = [rule.name for rule in guard.inputs]
    spots: dict[str, list[str]] = {}
    for rule in guard.inputs:
        for axis, dim in enumerate(rule.shape or ()):
            if isinstance(dim, str):
                spots.setdefault(dim, []).append(f"{rule.name}.shape[{axis}]")
    parts = [" == ".join(where) for where in spots.values() if len(where) > 1]
    parts += [f"{spots[dim][0]} in [{max(lo, SHIPPED_BELOW)}, {'inf' if hi is None else hi}]"
              for dim, lo, hi in guard.ranges if dim in spots]
    for tree, expected in guard.conditions:
        text = render(tree, names)
        parts.append(text if expected is True else f"not ({text})" if expected is False else f"{text} == {expected}")
    parts += [f"{rule.name} in [{rule.number[0]}, {'inf' if rule.number[1] is None else rule.number[1]}]"
              for rule in guard.inputs if rule.shape is None and rule.number is not None]
    if spots:
        parts.append(f"every dynamic size >= {SHIPPED_BELOW}")
    return "; ".join(dict.fromkeys(parts))  # the exporter records one condition more than once at times


class _Builder:
    """The guard as ONNX nodes over the inputs' shapes: every value an int64 or bool of shape [1]."""

    def __init__(self, guard: Guard) -> None:
        self.guard, self.nodes, self._sizes = guard, [], {}
        self.names = [rule.name for rule in guard.inputs]
        self._dims: dict[str, list[tuple[int, int]]] = {}  # dim name -> where it is: (input, axis)
        for i, rule in enumerate(guard.inputs):
            for axis, dim in enumerate(rule.shape or ()):
                if isinstance(dim, str):
                    self._dims.setdefault(dim, []).append((i, axis))

    # ------------------------------------------------------------------------------ the guard

    def holds(self) -> str | None:
        """The name of a bool [1] that is True exactly when the guard accepts the inputs, or
        ``None`` when there is nothing to check."""
        always = self._equal_dims() + self._numbers()
        ranges = {dim: (lo, hi) for dim, lo, hi in self.guard.ranges if dim in self._dims}
        traced = [self._range(dim, *ranges.get(dim, (0, None))) for dim in self._dims]  # lowest: SHIPPED_BELOW
        traced += [self._condition(tree, expected) for tree, expected in self.guard.conditions]
        points = [self._point(point) for point in self.guard.verified]
        if not always and not traced:
            return None
        inside = self._all(traced)
        if inside is not None and points:
            inside = self._op("Or", inside, *points) if len(points) == 1 else self._any([inside, *points])
        return self._all(always + ([inside] if inside is not None else []))

    def failing_unless(self, ok: str, text: str) -> str:
        """A bool [1], True, made by a Reshape named ``text`` that fails unless ``ok`` (to [-2])."""
        shape = self._op("Where", ok, self._const([1]), self._const([-2]))
        self.nodes.append(helper.make_node("Reshape", [self._op("Cast", ok, to=TensorProto.INT64), shape],
                                           [f"{PREFIX}.passed"], name=text))
        return self._op("Cast", f"{PREFIX}.passed", to=TensorProto.BOOL)

    def _equal_dims(self) -> list[str]:
        return [self._op("Equal", self._size(*spots[0]), self._size(*spot))
                for spots in self._dims.values() for spot in spots[1:]]

    def _numbers(self) -> list[str]:
        checks = []
        for i, rule in enumerate(self.guard.inputs):
            if rule.shape is None and rule.number is not None:
                lo, hi = rule.number
                value = self._number(i)
                checks.append(self._op("GreaterOrEqual", value, self._const(lo)))
                if hi is not None:
                    checks.append(self._op("LessOrEqual", value, self._const(hi)))
        return checks

    def _range(self, dim: str, lo: int, hi: int | None) -> str:
        size = self._size(*self._dims[dim][0])
        low = self._op("GreaterOrEqual", size, self._const(max(lo, SHIPPED_BELOW)))
        return low if hi is None else self._op("And", low, self._op("LessOrEqual", size, self._const(hi)))

    def _condition(self, tree: tuple, expected: Any) -> str:
        value, undefined = self._tree(tree)
        if expected is None:  # recorded undefined (a zero divisor): it holds while still undefined
            return undefined if undefined is not None else self._const(False)
        same = (value if expected else self._op("Not", value)) if isinstance(expected, bool) else \
            self._op("Equal", value, self._const(expected))
        return same if undefined is None else self._op("And", same, self._op("Not", undefined))

    def _point(self, point: Any) -> str:
        """A verified point: its dims at exactly its sizes, every condition at its outcome, and the
        other dims inside their ranges."""
        listed = {dim for dim, _ in point.sizes}
        checks = []
        for dim, size in point.sizes:
            value = self._number(self.names.index(dim[len(NUMBER_PREFIX):])) if dim.startswith(NUMBER_PREFIX) \
                else self._size(*self._dims[dim][0])
            checks.append(self._op("Equal", value, self._const(size)))
        checks += [self._condition(tree, outcome) for (tree, _), outcome in zip(self.guard.conditions, point.outcomes)]
        ranges = {dim: (lo, hi) for dim, lo, hi in self.guard.ranges}
        checks += [self._range(dim, *ranges.get(dim, (0, None))) for dim in self._dims if dim not in listed]
        return self._all(checks) or self._const(True)

    # ------------------------------------------------------------------------------- the trees

    def _tree(self, tree: Sequence[Any]) -> tuple[str, str | None]:
        """A condition tree's value, and a bool that is True where it divides by zero (or None)."""
        kind = tree[0]
        if kind == "size":
            return self._size(tree[1], tree[2]), None
        if kind == "num":
            return self._number(tree[1]), None
        if kind == "const":
            return self._const(tree[1]), None
        parts = [self._tree(child) for child in tree[1:]]
        values = [v for v, _ in parts]
        undefined = [u for _, u in parts if u is not None]
        if kind in ("floordiv", "mod"):
            a, b = values
            zero = self._op("Equal", b, self._const(0))
            safe = self._op("Where", zero, self._const(1), b)
            remainder = self._op("Mod", a, safe)  # fmod=0: the divisor's sign, as Python's %
            value = remainder if kind == "mod" else self._op("Div", self._op("Sub", a, remainder), safe)
            undefined.append(zero)
        elif kind in _COMPARE:
            value = self._op(_COMPARE[kind], *values)
        elif kind == "ne":
            value = self._op("Not", self._op("Equal", *values))
        elif kind == "neg":
            value = self._op("Neg", *values)
        elif kind == "not":
            value = self._op("Not", *values)
        else:
            value = self._op(_ARITHMETIC[kind], *values)
        return value, (self._any(undefined) if undefined else None)

    # ------------------------------------------------------------------------------ the nodes

    def _size(self, i: int, axis: int) -> str:
        if (i, axis) not in self._sizes:
            self._sizes[i, axis] = self._op("Shape", self.names[i], start=axis, end=axis + 1)
        return self._sizes[i, axis]

    def _number(self, i: int) -> str:
        as_int = self._op("Cast", self.names[i], to=TensorProto.INT64)
        return self._op("Reshape", as_int, self._const([1]))

    def _all(self, checks: list[str]) -> str | None:
        if not checks:
            return None
        return checks[0] if len(checks) == 1 else self._fold("And", checks)

    def _any(self, checks: list[str]) -> str:
        return checks[0] if len(checks) == 1 else self._fold("Or", checks)

    def _fold(self, op: str, values: list[str]) -> str:
        result = values[0]
        for value in values[1:]:
            result = self._op(op, result, value)
        return result

    def _const(self, value: Any) -> str:
        if isinstance(value, bool):
            tensor = helper.make_tensor("value", TensorProto.BOOL, [1], [value])
        elif isinstance(value, list):  # a shape operand, as given
            tensor = helper.make_tensor("value", TensorProto.INT64, [len(value)], value)
        else:
            tensor = helper.make_tensor("value", TensorProto.INT64, [1], [int(value)])
        return self._op("Constant", value=tensor)

    def _op(self, op_type: str, *inputs: str, **attributes: Any) -> str:
        name = f"{PREFIX}.{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attributes))
        return name


def _gated_inputs(graph: Any, inputs: Sequence[str], passed: str) -> list[Any]:
    """Each input's uses in the graph read it through a Reshape to its own shape, made once
    ``passed`` (the guard's failing node ran): onnxruntime does it in place."""
    nodes = []
    for n, name in enumerate(inputs):
        gated, shape, bad, target = (f"{PREFIX}.in{n}.{part}" for part in ("gated", "shape", "bad", "target"))
        rank = len(next(i for i in graph.input if i.name == name).type.tensor_type.shape.dim)
        _rename(graph, name, gated)
        nodes += [helper.make_node("Shape", [name], [shape]), _constant(bad, [-2] * rank),
                  helper.make_node("Where", [passed, shape, bad], [target]),
                  helper.make_node("Reshape", [name, target], [gated])]
    return nodes


def _constant(name: str, values: list[int]) -> Any:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values))


def _rename(graph: Any, old: str, new: str) -> None:
    """``old`` is ``new`` wherever the graph and its subgraphs make or read it."""
    for node in graph.node:
        node.output[:] = [new if o == old else o for o in node.output]
        node.input[:] = [new if i == old else i for i in node.input]
        for attribute in node.attribute:
            for sub in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                _rename(sub, old, new)
