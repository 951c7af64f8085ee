"""Integer powers, exact and wrapping as torch computes them.

torchlib writes ``a ** b`` of integers as ONNX's Pow, which onnxruntime computes through a double:
past 2**53 the last digits were wrong (``7 ** 20`` gave ...612000 for ...612001) and an overflow
saturated where torch wraps (``3 ** 40``). Ours is torch's ``powi`` (c10/util/generic_math.h):
square-and-multiply in the integer type, a product that overflows wrapping as it does in torch;
a negative exponent gives 0 but for a base of 1 (1) and -1 (+-1 by the exponent's parity).
A number exponent is unrolled by its bits; a tensor exponent takes one step per bit of its type
(63 for int64). Types onnxruntime has no integer product for (int8, int16, uint8) are computed
in int64 and cast back, which wraps the same. (A float32, float64 or bfloat16 to the power 0.5 or
-0.5 is torch's ``sqrt`` or ``rsqrt`` here too: the translation of ``x ** number`` is this module's.)
"""

from __future__ import annotations

from typing import Any

from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops import core
from onnxscript.onnx_opset import opset18 as op

_MULTIPLIED = (ir.DataType.INT32, ir.DataType.INT64)  # onnxruntime's integer Mul
_BITS = {ir.DataType.INT64: 63, ir.DataType.INT32: 31, ir.DataType.INT16: 15, ir.DataType.INT8: 7,
         ir.DataType.UINT8: 8}


def pow_tensor_tensor(self: Any, exponent: Any) -> Any:
    if not (_integer(self) and _integer(exponent) and self.dtype == exponent.dtype):
        return core.aten_pow(self, exponent)
    return _in_multiplied(self, lambda base: _powi_tensor(base, op.CastLike(exponent, base), _BITS[self.dtype]))


def pow_tensor_scalar(self: Any, exponent: Any) -> Any:
    if self.dtype in _ROOTED and isinstance(exponent, float) and exponent in (0.5, -0.5):
        # torch's sqrt and rsqrt: NaN at -inf, and 1 / -0.0 = -inf for -0.5 (C's pow: 0, +inf, inf)
        root = op.Sqrt(self)
        return root if exponent > 0 else op.Reciprocal(root)
    if not (_integer(self) and isinstance(exponent, int) and not isinstance(exponent, bool) and exponent >= 0):
        return core.aten_pow_tensor_scalar(self, exponent)
    return _in_multiplied(self, lambda base: _powi_number(base, exponent))


# The dtypes whose CPU kernel computes x ** 0.5 and x ** -0.5 as sqrt and rsqrt (float16's is pow's).
_ROOTED = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BFLOAT16})


def pow_scalar(self: Any, exponent: Any) -> Any:
    if not (isinstance(self, int) and not isinstance(self, bool) and _integer(exponent)):
        return core.aten_pow_scalar(self, exponent)
    base = op.CastLike(op.Constant(value_int=self), exponent)
    base.dtype, base.shape = exponent.dtype, ir.Shape([])
    return pow_tensor_tensor(base, exponent)


def _integer(x: Any) -> bool:
    return isinstance(x, ir.Value) and x.dtype in _BITS


def _in_multiplied(like: Any, compute: Any) -> Any:
    """``compute(like)`` in a type onnxruntime multiplies (int64 for the narrow ones), cast back."""
    if like.dtype in _MULTIPLIED:
        return compute(like)
    return op.Cast(compute(op.Cast(like, to=ir.DataType.INT64)), to=like.dtype)


def _powi_number(base: Any, exponent: int) -> Any:
    result, square = None, base
    while exponent:
        if exponent & 1:
            result = square if result is None else op.Mul(result, square)
        exponent >>= 1
        if exponent:
            square = op.Mul(square, square)
    return result if result is not None else op.CastLike(op.Expand(op.Constant(value_int=1), op.Shape(base)), base)


def _powi_tensor(base: Any, exponent: Any, bits: int) -> Any:
    one, zero, two = (op.CastLike(op.Constant(value_int=v), exponent) for v in (1, 0, 2))
    remaining = op.Max(exponent, zero)
    result, square = one, base  # broadcast to the inputs' shape by the first Where
    for step in range(bits):
        odd = op.Equal(op.BitwiseAnd(remaining, one), one)
        result = op.Where(odd, op.Mul(result, square), result)
        if step < bits - 1:
            square, remaining = op.Mul(square, square), op.Div(remaining, two)
    minus_one = op.Neg(one)
    negative = op.Where(op.Equal(base, one), one, op.Where(
        op.Equal(base, minus_one), op.Where(op.Equal(op.Mod(exponent, two), zero), one, minus_one), zero))
    return op.Where(op.Less(exponent, zero), negative, result)
