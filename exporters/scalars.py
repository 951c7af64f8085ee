"""Python numbers in float64 and half-precision graphs, as torch computes with them.

The exporter makes a number an operand by ``scalar_tensor(v, dtype)``, which torchlib builds as a
float32 constant cast to ``dtype``. In a float64 graph, ``x * 0.1`` multiplied by float32's 0.1:
results were float32-accurate (relative error 1e-8, not 1e-16), which verification at its float64
tolerance could not tell from round-off. Ours makes the constant in the graph's dtype from the
number itself.

In float16 and bfloat16 torch computes ``x / 65535.0`` in float32 (its "opmath" type), the
number in float32, and rounds the result once; the graph divided by float16's 65535, which is
inf, and served zeros (``x * 1e-8``: a multiplier of 0). Where the number is not exact in the
half type, ours computes the op as torch does: the tensor cast up, the number in float32, the
result cast back. Where it is exact, the half op is the same number (a product of two halves is
exact in float32) and stays as it is.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops import core
from onnxscript.onnx_opset import opset18 as op

from exporters import raising

_HALVES = {ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}


def scalar_tensor(s: Any, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False) -> Any:
    """A number as a 0-d tensor of ``dtype``: made in that dtype from the number (float64 keeps
    every digit); for a half dtype, a float32 constant cast down, which ``in_opmath`` reads back."""
    if isinstance(s, ir.Value):  # a number the trace did not fix: failing where torch raises
        return core.aten_scalar_tensor(raising.in_range(s, ir.DataType(dtype)) if dtype != -1 else s, dtype,
                                       layout, device, pin_memory)
    if isinstance(s, complex):
        return core.aten_scalar_tensor(s, dtype, layout, device, pin_memory)
    target = ir.DataType(dtype) if dtype != -1 else ir.DataType.FLOAT
    if target in _HALVES:
        return op.Cast(op.Constant(value=ir.tensor(np.array(s, dtype=np.float32))), to=target)
    return op.Constant(value=ir.tensor(np.array(s, dtype=target.numpy())))


def in_opmath(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``torchlib``'s binary op (add, sub, mul, div), computed in float32 where one operand is a
    half tensor and the other a number a half cannot hold exactly (``scalar_tensor`` above)."""

    def translated(self: Any, other: Any, *rest: Any, **options: Any) -> Any:
        half = self.dtype if self.dtype in _HALVES else other.dtype if _is_value(other) and other.dtype in _HALVES \
            else None
        wide = {id(v): _inexact_number(v, half) for v in (self, other)} if half is not None else {}
        if not any(w is not None for w in wide.values()):
            return torchlib(self, other, *rest, **options)
        self, other = (wide[id(v)] if wide.get(id(v)) is not None else _float32(v) for v in (self, other))
        return op.Cast(torchlib(self, other, *rest, **options), to=half)

    return translated


def _is_value(v: Any) -> bool:
    return isinstance(v, ir.Value)


def _float32(v: Any) -> Any:
    if not _is_value(v):
        return v
    cast = op.Cast(v, to=ir.DataType.FLOAT)
    cast.dtype, cast.shape = ir.DataType.FLOAT, v.shape  # what torchlib's translations read
    return cast


def _inexact_number(v: Any, half: ir.DataType) -> Any:
    """The float32 constant behind ``v`` when ``v`` is ``scalar_tensor``'s cast of one that the
    half type ``half`` cannot hold exactly; else ``None``."""
    if not _is_value(v) or v.dtype != half:
        return None
    cast = v.producer()
    if cast is None or cast.op_type != "Cast" or not cast.inputs or cast.inputs[0] is None:
        return None
    source = cast.inputs[0]
    constant = source.producer()
    value = constant.attributes.get("value") if constant is not None and constant.op_type == "Constant" else None
    tensor = value.as_tensor() if value is not None else None
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or tensor.size != 1:
        return None
    number = float(tensor.numpy())
    return None if torch.tensor(number, dtype=_HALVES[half]).item() == number else source
