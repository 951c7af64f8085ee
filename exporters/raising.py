"""Values torch raises on, made to fail the graph too, so the call runs eagerly and raises torch's error.

ONNX answers them: the max of nothing (a selection that came out empty) is NaN or the lowest
float, a class past ``one_hot``'s depth a row of zeros, a negative count a plausible tensor.
Each check here feeds its op's output through a ``Gather`` whose index is past the end where the
values are bad: onnxruntime refuses the run, the served call becomes a miss, the target raises
its own error, and the graph stays for the next call (as for a negative index, ``translations``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx_ir as ir
from onnxscript.function_libs.torch_lib.ops import core
from onnxscript.onnx_opset import opset18 as op


# In the name of a node that fails the run where the graph cannot answer exactly values torch
# answers: the caller answers that call eagerly and keeps the graph (``declining``).
DECLINES = "declines_these_values"


def declining(ok: Any, out: Any, dtype: Any) -> Any:
    """``unless``, its failing node named ``DECLINES``: for values torch answers (no error to
    raise) that the graph cannot (a NaN onnxruntime's kernel drops)."""
    return unless(ok, out, dtype, name=DECLINES)


def unless(ok: Any, out: Any, dtype: Any, name: str | None = None) -> Any:
    """``out`` (of ``dtype``: torchlib's values do not always say theirs), or a failed run where
    ``ok`` (a bool scalar) is false, in a node named after ``name`` where one is given."""
    one = op.Gather(op.Constant(value_ints=[1]), op.Cast(op.Not(ok), to=ir.DataType.INT64))  # [1][1]: past the end
    if name is not None:
        one.producer().name = f"{name}_{id(one)}"
    if dtype == ir.DataType.BOOL:
        return op.And(out, op.Cast(one, to=ir.DataType.BOOL))
    return op.Mul(out, op.CastLike(one, out))  # 1 * x is x: NaN, infinities and -0.0 stay


# What torch's checked conversion of a number into a tensor of these dtypes accepts (c10's
# ``overflows``): a fill value, a clamp bound, a 0-d tensor made from a number.
_RANGES = {
    ir.DataType.UINT8: (0, 255), ir.DataType.INT8: (-128, 127), ir.DataType.INT16: (-32768, 32767),
    ir.DataType.UINT16: (0, 65535), ir.DataType.INT32: (-2**31, 2**31 - 1), ir.DataType.FLOAT16: (-65504, 65504),
}


def in_range(value: Any, dtype: Any) -> Any:
    """``value``, a number the trace did not fix (a size, a number passed in), failing where it is
    out of ``dtype``'s range: torch raises there ("value cannot be converted to type uint8_t
    without overflow") and the graph's cast would wrap it (300 into uint8 served as 44). A number
    the trace fixed was checked by torch as it traced."""
    bounds = _RANGES.get(dtype) if isinstance(value, ir.Value) else None
    if bounds is None:
        return value
    low, high = (op.CastLike(op.Constant(value_int=b), value) for b in bounds)
    return unless(op.And(op.GreaterOrEqual(value, low), op.LessOrEqual(value, high)), value, value.dtype)


def full(size: Any, fill_value: Any, dtype: int = -1, layout: str = "", device: str = "",
         pin_memory: bool = False) -> Any:
    """torchlib's ``full``, failing where the fill value is out of ``dtype``'s range."""
    checked = in_range(fill_value, ir.DataType(dtype)) if dtype != -1 else fill_value
    return core.aten_full(size, checked, dtype, layout, device, pin_memory)


def new_full(self: Any, size: Any, fill_value: Any, dtype: int = -1, layout: str = "", device: str = "",
             pin_memory: bool = False) -> Any:
    """torchlib's ``new_full``, failing where the fill value is out of range."""
    checked = in_range(fill_value, ir.DataType(dtype) if dtype != -1 else self.dtype)
    return core.aten_new_full(self, size, checked, dtype, layout, device, pin_memory)


def full_like(self: Any, fill_value: Any, dtype: int = -1, layout: str = "", device: str = "", pin_memory: bool = False,
              memory_format: str = "") -> Any:
    """torchlib's ``full_like``, failing where the fill value is out of range."""
    checked = in_range(fill_value, ir.DataType(dtype) if dtype != -1 else self.dtype)
    return core.aten_full_like(self, checked, dtype, layout, device, pin_memory, memory_format)


def masked_fill(self: Any, mask: Any, value: Any) -> Any:
    """torchlib's ``masked_fill`` by a number, failing where it is out of ``self``'s range."""
    return core.aten_masked_fill(self, mask, in_range(value, self.dtype))


def fill(self: Any, value: Any) -> Any:
    """torchlib's ``fill`` (``fill_``) by a number, failing where it is out of ``self``'s range."""
    return core.aten_fill(self, in_range(value, self.dtype))


def _static_nonempty(x: Any, axes: Sequence[int]) -> bool:
    return all(isinstance(x.shape[a], int) and x.shape[a] > 0 for a in axes)


def _some(x: Any, axes: Sequence[int]) -> Any:
    """Whether ``x`` holds an element along ``axes``."""
    sizes = op.Gather(op.Shape(x), op.Constant(value_ints=list(axes)))
    return op.Greater(op.ReduceProd(sizes, keepdims=0), op.Constant(value_int=0))


def _axes(x: Any, dim: Any) -> list[int]:
    rank = len(x.shape)
    if dim is None or (isinstance(dim, Sequence) and not dim):
        return list(range(rank))
    return [d % rank for d in ([dim] if isinstance(dim, int) else dim)] if rank else []


def nonempty(x: Any, dim: Any, out: Any) -> Any:
    """``out``, a max or min of ``x`` over ``dim`` (``None`` or empty: every axis), failing where
    those axes hold nothing: torch raises ("Expected reduction dim to have non-zero size")."""
    axes = _axes(x, dim)
    if not axes or _static_nonempty(x, axes):
        return out
    ok = _some(x, axes)
    if isinstance(out, tuple):  # values, indices
        return unless(ok, out[0], x.dtype), unless(ok, out[1], ir.DataType.INT64)
    return unless(ok, out, x.dtype)


def lengths_nonzero(out: Any, axes: Sequence[int], dtype: Any) -> Any:
    """``out`` (of ``dtype``), failing where one of its ``axes`` is 0 long: a resize that shrank a
    length to nothing, where torch raises ("Input and output sizes should be greater than 0")."""
    return unless(_some(out, axes), out, dtype)


def one_hot(self: Any, num_classes: int = -1) -> Any:
    """``one_hot``: each class a row, failing on a negative class or one past ``num_classes``
    (ONNX's OneHot counts negatives from the end and leaves a class past the depth all zeros)."""
    labels = op.Cast(self, to=ir.DataType.INT64)
    zero = op.Constant(value_int=0)
    if num_classes < 0:  # as many classes as the highest label says; none in an empty tensor: torch raises
        depth = op.Add(op.ReduceMax(_with_zero(labels), keepdims=0), op.Constant(value_int=1))
        ok = op.And(_nonnegative(labels), op.Greater(op.Size(labels), zero))
    else:
        depth = op.Constant(value_int=num_classes)
        ok = op.And(_nonnegative(labels), op.Less(op.ReduceMax(_with_zero(labels), keepdims=0), depth))
    classes = op.Range(zero, depth, op.Constant(value_int=1))
    rows = op.Cast(op.Equal(op.Unsqueeze(labels, op.Constant(value_ints=[-1])), classes), to=ir.DataType.INT64)
    return unless(ok, rows, ir.DataType.INT64)


def bincount(self: Any, weights: Any | None = None, minlength: int = 0) -> Any:
    """torchlib's ``bincount``, failing on a negative number (torch raises; ONNX wraps it around)."""
    return unless(_nonnegative(self), core.aten_bincount(self, weights, minlength), ir.DataType.INT64)


def repeat_interleave(self: Any, repeats: Any | None = None, dim: int | None = None) -> Any:
    """torchlib's ``repeat_interleave`` of counts, failing on a negative count (torch raises)."""
    counts = self if repeats is None else repeats
    return unless(_nonnegative(counts), core.aten_repeat_interleave_Tensor(self, repeats, dim), self.dtype)


def _nonnegative(x: Any) -> Any:
    return op.GreaterOrEqual(op.ReduceMin(_with_zero(x), keepdims=0), op.Constant(value_int=0))


def _with_zero(x: Any) -> Any:
    """``x``'s values flat, as int64, and a 0 beside: the least and the most of nothing are 0."""
    return op.Concat(op.Reshape(op.Cast(x, to=ir.DataType.INT64), op.Constant(value_ints=[-1])),
                     op.Constant(value_ints=[0]), axis=0)
