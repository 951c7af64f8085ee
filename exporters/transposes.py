"""Attention's key transposes, each written as one ``Transpose``.

torchlib transposes the last two axes of attention's keys for any rank: it reshapes the keys to
3-D, transposes those, and reshapes back, the shapes cut out of ``Shape(keys)`` by three
``Slice`` and two ``Concat``: nine nodes per attention where one ``Transpose`` of the last two
axes computes the same tensor. onnxruntime runs each node for itself (about half a microsecond
apiece on this project's machine, whatever its size), so a two-layer decoder step with self- and
cross-attention spent 14% of its run on them (BART tiny with past: 102 -> 87 us, the same numbers
bit for bit). onnxruntime then folds the one ``Transpose`` into the product that reads it, and the
fusions of ``exporters.fusion`` recognise it as the keys' transpose as well.
"""

from __future__ import annotations

import onnx_ir as ir


def fold_key_transposes(graph: ir.Graph) -> int:
    """Replace each ``Reshape(Transpose(Reshape(x, [-1, L, E]), [0, 2, 1]), [*batch, E, L])`` of
    ``graph`` whose shapes are read from ``Shape(x)`` (torchlib's key transpose) by ``Transpose(x)``
    of its last two axes, and drop the nodes left unread. Returns how many."""
    count = 0
    for node in list(graph):
        source = _key_transposed(node)
        if source is None:
            continue
        rank = len(source.shape)
        transpose = ir.Node("", "Transpose", [source], [ir.AttrInt64s("perm", [*range(rank - 2), rank - 1, rank - 2])],
                            num_outputs=1, name=f"{node.name}_transpose", metadata_props=dict(node.metadata_props))
        graph.insert_before(node, transpose)
        out, dims = transpose.outputs[0], list(source.shape)
        out.dtype, out.shape = source.dtype, ir.Shape([*dims[:-2], dims[-1], dims[-2]])
        node.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
        count += 1
    if count:
        _drop_unread(graph)
    return count


def _key_transposed(node: ir.Node) -> ir.Value | None:
    """``x`` when ``node`` is the outer ``Reshape`` of torchlib's key transpose of ``x``, else None."""
    if not _plain(node, "Reshape") or _int(node, "allowzero", 0):
        return None
    transpose = node.inputs[0].producer() if node.inputs[0] is not None else None
    if transpose is None or not _plain(transpose, "Transpose") or _ints(transpose, "perm") != [0, 2, 1]:
        return None
    inner = transpose.inputs[0].producer()
    if inner is None or not _plain(inner, "Reshape") or _int(inner, "allowzero", 0):
        return None
    source = inner.inputs[0]
    if source is None or source.shape is None or len(source.shape) < 3:
        return None
    rank = len(source.shape)
    squeezed, restored = _concatenated(inner.inputs[1]), _concatenated(node.inputs[1])
    if squeezed is None or restored is None or len(squeezed) != 3 or len(restored) != 3:
        return None
    if _constant_ints(squeezed[0]) != [-1]:
        return None
    batch, last, second_last = (0, rank - 2), (rank - 1, rank), (rank - 2, rank - 1)
    wanted = [(squeezed[1], second_last), (squeezed[2], last), (restored[0], batch), (restored[1], last),
              (restored[2], second_last)]
    if all(_slice_of_shape(value, rank) == (source, span) for value, span in wanted):
        return source
    return None


def _slice_of_shape(value: ir.Value | None, rank: int) -> tuple[ir.Value, tuple[int, int]] | None:
    """``(x, (start, end))`` when ``value`` is ``Slice(Shape(x), start, end)`` with constant
    bounds, on axis 0 and step 1, the bounds normalised to ``rank``."""
    node = value.producer() if value is not None else None
    if node is None or not _plain(node, "Slice") or not 3 <= len(node.inputs) <= 5:
        return None
    shape = node.inputs[0].producer() if node.inputs[0] is not None else None
    if shape is None or not _plain(shape, "Shape") or _int(shape, "start", 0) or "end" in shape.attributes:
        return None
    starts, ends = _constant_ints(node.inputs[1]), _constant_ints(node.inputs[2])
    axes = _constant_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = _constant_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes not in (None, [0], [-1]) or steps not in (None, [1]):
        return None
    return shape.inputs[0], (_clamped(starts[0], rank), _clamped(ends[0], rank))


def _clamped(index: int, rank: int) -> int:
    return min(max(index + rank if index < 0 else index, 0), rank)


def _concatenated(value: ir.Value | None) -> list[ir.Value | None] | None:
    node = value.producer() if value is not None else None
    if node is None or not _plain(node, "Concat") or _int(node, "axis", None) not in (0, -1):
        return None
    return list(node.inputs)


def _constant_ints(value: ir.Value | None) -> list[int] | None:
    """The integers of a constant (an initializer or a ``Constant`` node), else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else [int(v) for v in tensor.numpy().reshape(-1)]


def _plain(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _int(node: ir.Node, name: str, default: int | None) -> int | None:
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.as_int()


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attribute = node.attributes.get(name)
    return None if attribute is None else list(attribute.as_ints())


def _drop_unread(graph: ir.Graph) -> None:
    """Remove the nodes of ``graph`` (not of its subgraphs) none of whose outputs is read, repeatedly."""
    outputs = {id(v) for v in graph.outputs}
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if all(not v.uses() and id(v) not in outputs for v in node.outputs):
                graph.remove(node, safe=True)
                changed = True
