"""Edits on an exported ``onnx_ir.Model``: output names and dtypes, dim names, metadata.

The torch.export-based exporter names things after its own tracer (``add_3``, ``s77``); these passes
give the graph the names its users know and fix the output dtypes the exporter may have upcast.
"""

from __future__ import annotations

import re
from typing import Any, Container, Mapping, Sequence

import onnx_ir as ir

_SYMBOL = re.compile(r"\b[su]\d+\b")


def _all_values(graph: ir.Graph):
    yield from graph.inputs
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs


def _identity(graph: ir.Graph, value: ir.Value) -> ir.Value:
    node = ir.Node("", "Identity", [value], num_outputs=1)
    graph.append(node)
    out = node.outputs[0]
    out.dtype, out.shape = value.dtype, value.shape
    return out


def fix_outputs(model: ir.Model, names: Sequence[str], dtypes: Sequence[ir.DataType]) -> None:
    """Name the graph outputs and give each the dtype eager returned.

    An output that is also a graph input, or that appears twice, gets its own Identity so each
    output is a value of its own. An output whose dtype differs from eager's (the exporter upcasts
    some low-precision reductions) gets a Cast back to eager's dtype; a float64 output the graph
    rounded to float32 from a double (a Python float: ``sizes.as_doubles`` declares it float32)
    is that double.
    """
    graph = model.graph
    seen: set[int] = set()
    for i, (value, dtype) in enumerate(zip(list(graph.outputs), dtypes)):
        if value.is_graph_input() or id(value) in seen or value.is_initializer():
            value = _identity(graph, value)
        if dtype == ir.DataType.DOUBLE and value.dtype == ir.DataType.FLOAT:
            value = _unrounded(value)
        if value.dtype != dtype:
            node = ir.Node("", "Cast", [value], [ir.AttrInt64("to", dtype)], num_outputs=1)
            graph.append(node)
            cast = node.outputs[0]
            cast.dtype, cast.shape = dtype, value.shape
            value = cast
        graph.outputs[i] = value
        seen.add(id(value))
    for value, name in zip(graph.outputs, names):
        value.name = name


def _unrounded(value: ir.Value) -> ir.Value:
    """The double ``value`` was cast to float32 from, if it was; else ``value``."""
    node = value.producer()
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return value
    source = node.inputs[0]
    return source if source is not None and source.dtype == ir.DataType.DOUBLE else value


# ONNX ops whose indices input must be int64 (torchlib passes int32 indices through as they came:
# onnxruntime then refuses the model). Gather, GatherElements and ScatterElements take int32 too.
_INT64_INDICES = {"GatherND": 1, "ScatterND": 1}


def widen_indices(model: ir.Model) -> None:
    """Cast int32 indices to int64 where the op takes int64 only (``w[ids]`` with int32 ``ids``)."""
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        position = _INT64_INDICES.get(node.op_type) if node.domain == "" else None
        indices = node.inputs[position] if position is not None else None
        if indices is None or indices.dtype != ir.DataType.INT32:
            continue
        widen = ir.Node("", "Cast", [indices], [ir.AttrInt64("to", ir.DataType.INT64)], num_outputs=1)
        widen.outputs[0].dtype, widen.outputs[0].shape = ir.DataType.INT64, indices.shape
        node.graph.insert_before(node, widen)
        node.replace_input_with(position, widen.outputs[0])


def pin_dims(model: ir.Model, pinned: Mapping[str, int]) -> None:
    """Make dims whose symbol the exporter pinned to one value (range [v, v]) static ``v``."""
    if not pinned:
        return
    for value in _all_values(model.graph):
        shape = value.shape
        if shape is None or not any(isinstance(d, ir.SymbolicDim) and d.value in pinned for d in shape):
            continue
        value.shape = ir.Shape([pinned[d.value] if isinstance(d, ir.SymbolicDim) and d.value in pinned else d for d in shape])


def pin_derived_inputs(model: ir.Model, examples: Sequence[Any], guarded: Container[tuple[int, int]]) -> None:
    """Input dims the exporter wrote as expressions of other dims (``2*s0``): a dim of its own
    where the guard checks the expression (``guarded`` (input, axis) pairs:
    ``conditions.derived_dims``), else static at the example.

    The guard compares dim names, not arithmetic: an expression dim it does not check is pinned so
    that a call is never served where the relation does not hold (a drift re-captures instead).
    """
    for i, (value, example) in enumerate(zip(model.graph.inputs, examples)):
        shape = value.shape
        if shape is None or not hasattr(example, "shape"):
            continue
        dims = [
            d if not (isinstance(d, ir.SymbolicDim) and d.value and not d.value.isidentifier())
            else ir.SymbolicDim(f"{value.name}_dim{a}") if (i, a) in guarded else int(example.shape[a])
            for a, d in enumerate(shape)
        ]
        value.shape = ir.Shape(dims)


def name_inputs(model: ir.Model, names: Sequence[str]) -> None:
    """Rename the graph inputs (the exporter may have renamed them to avoid clashes)."""
    for value, name in zip(model.graph.inputs, names):
        value.name = name


def name_dims(
    model: ir.Model, declared: Sequence[Mapping[int, str]], declared_outputs: Mapping[str, Mapping[int, str | None]],
    numbers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Replace exporter symbols (``s77``) by meaningful dim names everywhere in the graph.

    ``declared[i]`` maps axes of input ``i`` to user-given names, ``declared_outputs`` axes of
    outputs by output name (inputs win where both name one symbol); ``numbers`` maps the symbols
    of Python numbers fed to the graph to their input names (a dim ``Min(k, x_dim0)``). Any other
    symbol is named after the first input and axis that carries it (``input_ids_dim1``); a symbol
    seen only on an output is named after that output. Returns the mapping symbol -> name applied.
    """
    graph = model.graph
    renames: dict[str, str] = {}
    taken: set[str] = set()

    def claim(symbol: str, name: str, declared: bool = False) -> None:
        # Declared names may cover several symbols (equal names mean equal sizes); a discovered
        # name never reuses a taken one.
        if symbol in renames:
            return
        base, k = name, 1
        while name in taken and not declared:
            k += 1
            name = f"{base}_{k}"
        renames[symbol] = name
        taken.add(name)

    for symbol, name in (numbers or {}).items():
        claim(symbol, name, declared=True)
    for value, names in zip(graph.inputs, declared):
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None and axis in names:
                claim(dim.value, names[axis], declared=True)
    for value in graph.outputs:
        for axis, name in declared_outputs.get(value.name, {}).items():
            dims = value.shape or ()
            if name and axis < len(dims) and isinstance(dims[axis], ir.SymbolicDim) and dims[axis].value:
                claim(dims[axis].value, name, declared=True)
    for value in list(graph.inputs) + list(graph.outputs):
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None and _SYMBOL.fullmatch(dim.value):
                claim(dim.value, f"{value.name}_dim{axis}")

    def rename(text: str, value: ir.Value, axis: int) -> str:
        text = _SYMBOL.sub(lambda m: renames.get(m.group(0), m.group(0)), text)
        # A symbol no input carries (a data-dependent size): the dim is named after its value.
        return f"{value.name}_dim{axis}" if _SYMBOL.search(text) else text

    for value in _all_values(graph):
        shape = value.shape
        if shape is None or not any(isinstance(d, ir.SymbolicDim) for d in shape):
            continue
        value.shape = ir.Shape([
            ir.SymbolicDim(rename(d.value, value, a)) if isinstance(d, ir.SymbolicDim) and d.value else d
            for a, d in enumerate(shape)
        ])
    return renames


def input_dims(model: ir.Model) -> list[tuple[int | str | None, ...]]:
    """Each graph input's dims: an int where static, the dim name where dynamic."""
    return [
        tuple(d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in v.shape or ())
        for v in model.graph.inputs
    ]
