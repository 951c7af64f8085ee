"""Integer sums, products and narrowing casts as torch computes them: exact, wrapping around at
their dtype's width.

onnxruntime's integer ``ReduceSum`` accumulates in double. An int32 sum past 2**31 - 1 saturated
(2147483647 served where eager gives 0), and an int64 sum past 2**53 lost its last digits
(2**53 + 1 + 1 served as 2**53) and saturated past 2**63 where torch wraps. Every integer sum of
the main graph is made exact:

- an int32 sum is summed in int64 and cast back (the cast wraps);
- an int64 sum is split into three 21-bit limbs, each summed in onnxruntime's double (exact for
  fewer than 2**31 terms), and the limb sums are put back together with int64 ``Mul`` and ``Add``,
  which wrap as torch does. Terms cast from a bool or an integer of 16 bits or fewer cannot reach
  2**53 in a sum of fewer than 2**37 of them: those sums (lengths from attention masks, counts)
  stay one node.

Its integer ``ReduceProd`` multiplies in double too: 3**39 * 3 was served as 2**63 - 1, an int32
product past 2**31 as 2147483647. A product of integers is exact in double while it stays below
2**53 (no partial product of nonzero integers is larger than the whole), so an integer product is
taken in double and cast back (through int64, so that an int32 one wraps), and a call whose
product reaches 2**53 (or NaN: an infinity times 0) fails the graph's ``DECLINES`` node: the
target answers that call and the graph serves the next one.

onnxruntime merges a cast from a float to an integer and a cast of that integer to a narrower one
into one cast from the float, which saturates where torch's second cast wraps (``x.long().int()``:
2**32 + 5 was served as 2147483647, not 5). Such a narrowing is written as the wrap it is (a
``BitwiseAnd`` in the wider type), so that the cast after it only ever meets values it holds.

Branches of an ``If`` (``torch.cond``) are rewritten too; every value made here has a name of its
own (``_unique_name``): names a subgraph's values got repeated the main graph's, which
onnxruntime refuses.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import onnx_ir as ir

from exporters.raising import DECLINES

_LIMB = 21  # bits: a limb sum of fewer than 2**31 terms stays below 2**52
_SHAPE_OPS = {"Shape", "Size", "Constant", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Cast"}
_SMALL = {ir.DataType.BOOL, ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.UINT16, ir.DataType.INT16}


def exact(model: ir.Model) -> None:
    """Rewrite the int32 and int64 ``ReduceSum`` and ``ReduceProd`` nodes to be exact and wrap, or
    decline the call; and the narrowing casts of a cast to wrap (branches included)."""
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.domain != "" or not node.inputs or node.inputs[0] is None:
            continue
        if node.op_type == "Cast" and _narrowing_a_cast(node):
            _wrapped(node)
        if node.inputs[0].dtype not in (ir.DataType.INT32, ir.DataType.INT64):
            continue
        if node.op_type == "ReduceSum" and node.inputs[0].dtype == ir.DataType.INT32:
            _wrapped_from_int64(node)
        elif node.op_type == "ReduceSum" and not _small_terms(node.inputs[0]):
            _in_limbs(node)
        elif node.op_type == "ReduceProd" and not _of_sizes(node.inputs[0]):
            _in_double(node)


_BITS = {ir.DataType.INT64: 64, ir.DataType.INT32: 32, ir.DataType.INT16: 16, ir.DataType.INT8: 8,
         ir.DataType.UINT8: 8, ir.DataType.UINT16: 16, ir.DataType.UINT32: 32}
_UNSIGNED = {ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32}


class _Nodes:
    """The nodes one rewrite makes, in the order they run, each output typed."""

    def __init__(self) -> None:
        self.made: list[ir.Node] = []

    def add(self, op: str, inputs: list[ir.Value], dtype: ir.DataType, attributes: Iterable[ir.Attr] = (),
            name: str | None = None) -> ir.Value:
        made = ir.Node("", op, inputs, list(attributes), num_outputs=1, name=name)
        made.outputs[0].dtype, made.outputs[0].name = dtype, _unique_name()
        self.made.append(made)
        return made.outputs[0]

    def constant(self, value: float | list[int], dtype: ir.DataType) -> ir.Value:
        out = self.add("Constant", [], dtype, [ir.AttrTensor("value", ir.tensor(value, dtype=dtype))])
        out.shape = ir.Shape([] if not isinstance(value, list) else [len(value)])
        return out

    def cast(self, value: ir.Value, to: ir.DataType) -> ir.Value:
        return self.add("Cast", [value], to, [ir.AttrInt64("to", to)])

    def wrapped(self, value: ir.Value, to: ir.DataType) -> ir.Value:
        """``value`` (an integer) wrapped into ``to``'s range, still in its own type: ``x & mask``
        (unsigned) or ``((x + half) & mask) - half`` (signed)."""
        dtype, bits = value.dtype, _BITS[to]
        mask = self.constant((1 << bits) - 1, dtype)
        if to in _UNSIGNED:
            return self.add("BitwiseAnd", [value, mask], dtype)
        half = self.constant(1 << (bits - 1), dtype)
        low = self.add("BitwiseAnd", [self.add("Add", [value, half], dtype), mask], dtype)
        return self.add("Sub", [low, half], dtype)


_NAMES = itertools.count()


def _unique_name() -> str:
    """A value name no other scope has: names the graph would give a subgraph's new values
    repeat the main graph's, which onnxruntime refuses (single static assignment)."""
    return f"exact_integers_{next(_NAMES)}"


def _narrowing_a_cast(node: ir.Node) -> bool:
    source, to = node.inputs[0], node.attributes["to"].as_int()
    producer = source.producer()
    return (producer is not None and producer.op_type == "Cast" and source.dtype in _BITS
            and to in _BITS and _BITS[to] < _BITS[source.dtype])


def _wrapped(node: ir.Node) -> None:
    """``node``, a cast to a narrower integer, given a value already in its range."""
    nodes = _Nodes()
    in_range = nodes.wrapped(node.inputs[0], ir.DataType(node.attributes["to"].as_int()))
    node.graph.insert_before(node, nodes.made)
    node.replace_input_with(0, in_range)


def _small_terms(value: ir.Value) -> bool:
    producer = value.producer()
    return (producer is not None and producer.op_type == "Cast" and producer.domain == ""
            and producer.inputs[0] is not None and producer.inputs[0].dtype in _SMALL)


def _of_sizes(value: ir.Value) -> bool:
    """Whether ``value`` is computed from shapes and constants only (a count of elements: far
    below 2**53)."""
    producer = value.producer()
    if producer is None or producer.op_type not in _SHAPE_OPS or producer.domain != "":
        return False
    return producer.op_type in ("Shape", "Size", "Constant") or all(
        _of_sizes(source) for source in producer.inputs if source is not None)


def _in_double(node: ir.Node) -> None:
    """``node``'s integer product taken in double, cast back, failing the run where it is not exact."""
    dtype, nodes, double, int64 = node.inputs[0].dtype, _Nodes(), ir.DataType.DOUBLE, ir.DataType.INT64
    product = nodes.add("ReduceProd", [nodes.cast(node.inputs[0], double), *node.inputs[1:]], double,
                        node.attributes.values())
    exact = nodes.add("Less", [nodes.add("Abs", [product], double), nodes.constant(2.0**53, double)], ir.DataType.BOOL)
    past = nodes.cast(nodes.add("Not", [exact], ir.DataType.BOOL), int64)
    one = nodes.add("Gather", [nodes.constant([1], int64), past], int64,
                    name=f"{node.name or 'prod'}_{DECLINES}")  # [1][1] is past the end
    out = nodes.cast(product, int64)
    if dtype == ir.DataType.INT32:  # wrapped in int64 first (two casts in a row merge into one that saturates)
        out, one = nodes.cast(nodes.wrapped(out, dtype), dtype), nodes.cast(one, dtype)
    total = nodes.add("Mul", [out, one], dtype)
    total.shape = node.outputs[0].shape
    _replace(node, nodes.made, total)


def _wrapped_from_int64(node: ir.Node) -> None:
    nodes = _Nodes()
    summed = _like(node, nodes.cast(node.inputs[0], ir.DataType.INT64), ir.DataType.INT64)
    nodes.made.append(summed)
    back = nodes.cast(summed.outputs[0], ir.DataType.INT32)
    back.shape = node.outputs[0].shape
    _replace(node, nodes.made, back)
    _in_limbs(summed)  # an int32 sum of more than 2**22 large terms passes 2**53 in int64 too


def _in_limbs(node: ir.Node) -> None:
    """``node``'s int64 sum as the wrapped sum of its terms' three limbs: ``x = a + b * 2**21 + c *
    2**42`` with ``a`` and ``b`` in [0, 2**21) and ``|c| <= 2**21``."""
    nodes, int64 = _Nodes(), ir.DataType.INT64
    mask, base = nodes.constant((1 << _LIMB) - 1, int64), nodes.constant(1 << _LIMB, int64)
    limbs, rest = [], node.inputs[0]
    for _ in range(2):
        limb = nodes.add("BitwiseAnd", [rest, mask], int64)
        rest = nodes.add("Div", [nodes.add("Sub", [rest, limb], int64), base], int64)  # exact: the low bits are gone
        limbs.append(limb)
    limbs.append(rest)
    low, middle, high = (_summed(nodes, node, limb) for limb in limbs)
    upper = nodes.add("Add", [middle, nodes.add("Mul", [high, base], int64)], int64)  # (b + c * 2**21)
    total = nodes.add("Add", [low, nodes.add("Mul", [upper, base], int64)], int64)
    total.shape = node.outputs[0].shape
    _replace(node, nodes.made, total)


def _summed(nodes: _Nodes, node: ir.Node, data: ir.Value) -> ir.Value:
    reduce = _like(node, data, ir.DataType.INT64)
    nodes.made.append(reduce)
    return reduce.outputs[0]


def _like(node: ir.Node, data: ir.Value, dtype: ir.DataType) -> ir.Node:
    """A ``ReduceSum`` over ``data`` with ``node``'s axes and attributes."""
    made = ir.Node("", "ReduceSum", [data, *node.inputs[1:]], list(node.attributes.values()), num_outputs=1)
    made.outputs[0].dtype, made.outputs[0].shape, made.outputs[0].name = dtype, node.outputs[0].shape, _unique_name()
    return made


def _replace(node: ir.Node, nodes: list[ir.Node], out: ir.Value) -> None:
    graph, name = node.graph, node.outputs[0].name
    graph.insert_before(node, nodes)
    node.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    if name is not None:  # a graph output keeps its name
        out.name = name
