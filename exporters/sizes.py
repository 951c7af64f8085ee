"""Python numbers computed from sizes or read out of tensors, in double and with Python's floor,
as Python computes them.

torch.export keeps ``int(n * 2.3)`` (interpolate's output length for a scale factor) as Python
arithmetic on the dynamic size ``n``: ``sym_float``, ``*``, ``math.trunc``. The exporter makes
every such float a float32 (``sym_float`` is a Cast to FLOAT, ``/`` divides in FLOAT), so where
``n * 2.3`` is just below an integer in double it rounds up to it in float32: at n = 50, 90, 100
the graph served one output column more than eager. And ``//`` of sizes divided toward zero, not
down: ``-(-n // 4)`` (a ceiling) came out one short.

Here those floats are doubles. The exporter still declares each of them FLOAT (it types every
symbolic float so), so ``as_doubles`` runs on the exported model before anything reads the
types: it declares them DOUBLE, and gives every other consumer (a tensor op that takes the number
as a float32 operand, as torch rounds a Python number to the tensor's dtype) a Cast to FLOAT.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnxscript.function_libs.torch_lib.ops import core
from onnxscript.onnx_opset import opset18 as op

_DOUBLE = "clika_runtime.double"  # marks a value this module computed in double (``as_doubles``)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_FLOAT_TYPES = frozenset(int(t) for t in _FLOATS)


def _double(x: Any) -> Any:
    """``x`` (a graph value or a Python number) as a double scalar."""
    if isinstance(x, ir.Value):
        return op.Cast(x, to=ir.DataType.DOUBLE)
    return op.Constant(value=ir.tensor(np.array(x, dtype=np.float64)))


def _is_float(x: Any) -> bool:
    return isinstance(x, float) or (isinstance(x, ir.Value) and x.dtype in _FLOATS)


def _marked(value: Any) -> Any:
    value.meta[_DOUBLE] = True
    return value


def sym_float(self: Any) -> Any:
    """``float(n)``: a double, as a Python float is."""
    return _marked(op.Cast(self, to=ir.DataType.DOUBLE))


def local_scalar_dense(self: Any) -> Any:
    """``x.item()`` of a float tensor: a Python float, so a double (torchlib's is a float32,
    which rounded a float64 tensor's value); ints and bools as torchlib reads them."""
    if self.dtype not in _FLOATS:
        return core.aten__local_scalar_dense(self)
    return _marked(op.Cast(op.Gather(op.Reshape(self, op.Constant(value_ints=[-1])), 0), to=ir.DataType.DOUBLE))


def _arithmetic(onnx_op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``a <op> b`` of sizes and numbers: in double where either is a float, else in int64."""
    def apply(self: Any, other: Any) -> Any:
        if _is_float(self) or _is_float(other):
            return _marked(onnx_op(_double(self), _double(other)))
        return onnx_op(self, other)
    return apply


def truediv(self: Any, other: Any) -> Any:
    """``a / b``: always a float in Python, here a double."""
    return _marked(op.Div(_double(self), _double(other)))


def floordiv(self: Any, other: Any) -> Any:
    """``a // b`` with Python's floor (toward minus infinity), for ints and floats."""
    if _is_float(self) or _is_float(other):
        return _marked(op.Floor(op.Div(_double(self), _double(other))))
    quotient = op.Div(self, other)  # toward zero
    inexact = op.Not(op.Equal(op.Mul(quotient, other), self))
    signs_differ = op.Xor(op.Less(self, op.Constant(value_int=0)), op.Less(other, op.Constant(value_int=0)))
    return op.Sub(quotient, op.Cast(op.And(inexact, signs_differ), to=ir.DataType.INT64))


def neg(self: Any) -> Any:
    return _marked(op.Neg(_double(self))) if _is_float(self) else op.Neg(self)


def _to_int(rounding: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """``math.trunc`` / ``floor`` / ``ceil`` of a number: from its double, to int64."""
    def apply(self: Any) -> Any:
        if not _is_float(self):
            return self
        value = _double(self)
        return op.Cast(value if rounding is None else rounding(value), to=ir.DataType.INT64)  # Cast truncates
    return apply


def _arange(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.arange`` of floats (``arange(0, n, 0.7)``, ``arange(n * 0.5)``): torch computes the
    length ``ceil((end - start) / step)`` and each value in double, and rounds the values to the
    dtype; torchlib's Range ran in float32, where ``14 / 0.7`` is 20, not double's 20.000000000000004
    (ceil: 21), and served one value fewer. Integer ranges stay torchlib's."""
    def arange(*numbers: Any, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False) -> Any:
        floating = dtype in _FLOAT_TYPES if dtype not in (-1, None) else any(map(_is_float, numbers))
        if not floating:
            return torchlib(*numbers, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)
        start, end, step = (0, *numbers, 1) if len(numbers) == 1 else (*numbers, 1)[:3]
        values = op.Range(_double(start), _double(end), _double(step))
        target = ir.DataType.FLOAT if dtype in (-1, None) else ir.DataType(dtype)
        return values if target == ir.DataType.DOUBLE else op.Cast(values, to=target)
    return arange


TABLE: dict[Any, Callable[..., Any]] = {
    torch.sym_float: sym_float,
    torch.ops.aten._local_scalar_dense.default: local_scalar_dense,
    operator.add: _arithmetic(op.Add),
    operator.sub: _arithmetic(op.Sub),
    operator.mul: _arithmetic(op.Mul),
    operator.pow: _arithmetic(op.Pow),
    operator.truediv: truediv,
    operator.floordiv: floordiv,
    operator.neg: neg,
    math.trunc: _to_int(None),
    math.floor: _to_int(op.Floor),
    math.ceil: _to_int(op.Ceil),
    torch.sym_max: _arithmetic(op.Max),
    torch.sym_min: _arithmetic(op.Min),
    torch.ops.aten.arange.default: _arange(core.aten_arange),
    torch.ops.aten.arange.start: _arange(core.aten_arange_start),
    torch.ops.aten.arange.start_step: _arange(core.aten_arange_start_step),
}


def as_doubles(graph: ir.Graph) -> None:
    """Declare the values ``TABLE`` computed in double as DOUBLE (the exporter declared them
    FLOAT), and feed every consumer but this module's own Casts a float32 copy."""
    for node in list(graph):
        for value in node.outputs:
            if value.meta.get(_DOUBLE) and value.dtype != ir.DataType.DOUBLE:
                _declared_double(graph, node, value)


def _declared_double(graph: ir.Graph, node: ir.Node, value: ir.Value) -> None:
    value.dtype = ir.DataType.DOUBLE
    others = [(user, index) for user, index in value.uses() if not _reads_double(user, index)]
    outputs = [i for i, out in enumerate(graph.outputs) if out is value]
    if not others and not outputs:
        return
    cast = ir.node("Cast", inputs=[value], attributes={"to": ir.DataType.FLOAT})
    single = cast.outputs[0]
    single.dtype, single.shape = ir.DataType.FLOAT, value.shape
    graph.insert_after(node, cast)
    for user, index in others:
        user.replace_input_with(index, single)
    for i in outputs:  # a graph output keeps its name and float32 type
        single.name, value.name = value.name, f"{value.name}_double"
        graph.outputs[i] = single


def _reads_double(node: ir.Node, index: int) -> bool:
    """Whether ``node`` takes input ``index`` as the double it is: a Cast, or what a CastLike
    casts (each rounds the double once, as torch rounds a Python number)."""
    return node.domain in ("", "ai.onnx") and (node.op_type == "Cast" or (node.op_type == "CastLike" and index == 0))
