"""Translations of the ops that read a float's sign, and of float rounding division, where
torchlib's answer is not torch's at values a capture is rarely verified at.

Floor division and remainder: torchlib computes ``floor(a / b)`` and ``a - b * floor(a / b)``.
The quotient rounds first, so ``0.7 // 0.1`` gave 7 where torch (and Python) give 6, ``0.7 % 0.1``
gave 0 where torch gives 0.1, and an infinite divisor gave NaN (``1 % inf`` is 1 in torch). Ours
follow torch's kernels, which start from the exact ``fmod`` (c10/util/generic_math.h
``div_floor_floating``; ``remainder_kernel`` in aten/src/ATen/native/cpu/BinaryOpsKernel.cpp).

``atan2``: torchlib's quadrant tests (``x < 0``) miss -0.0, so the angle of a point on the
negative x-axis with y = +0 came out -pi, and a NaN came out 0. Ours follows C's ``atan2``: the
sign bits decide the quadrant, both zeros and both infinities are their own cases, NaN stays NaN.

``sign``, ``sgn``, ``heaviside`` and ``angle`` of a NaN: torch's CPU kernels give 0, 0, 0 and NaN
(``(0 < x) - (x < 0)``, ``x == 0 ? v : x > 0``, ``isnan(x) ? x : (x < 0) * pi``); onnxruntime's
Sign gives NaN, torchlib's heaviside 1 and its angle 0.

``signbit``: torchlib's ``x < 0`` said False for -0.0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops import core
from onnxscript.onnx_opset import opset18 as op

from exporters.dtypes import number_like


def signbit(self: Any) -> Any:
    """Whether the sign bit is set: also for -0.0, whose reciprocal is -inf."""
    if not self.dtype.is_floating_point():
        return core.aten_signbit(self)
    return _negative(self)


def _negative(x: Any) -> Any:
    zero = number_like(0.0, x)
    return op.Or(op.Less(x, zero), op.And(op.Equal(x, zero), op.Less(op.Reciprocal(x), zero)))


def floor_divide(self: Any, other: Any) -> Any:
    """torch's floor division of floats: from ``fmod``, rounded to the nearest integer below."""
    other = _operand(other, self)
    mod = op.Mod(self, other, fmod=1)
    div = op.Div(op.Sub(self, mod), other)
    div = op.Where(_opposite_signs(mod, other), op.Sub(div, number_like(1.0, self)), div)
    floored = op.Floor(div)
    floored = op.Where(op.Greater(op.Sub(div, floored), number_like(0.5, self)), op.Add(floored, number_like(1.0, self)), floored)
    quotient = op.Div(self, other)
    out = op.Where(op.Equal(other, number_like(0.0, self)), quotient, floored)
    # A zero takes the quotient's sign (torch's copysign(0, a / b)), by a product: onnxruntime's
    # Where gave +0 for a -0.0 its true branch picked.
    flip = op.And(op.Equal(out, number_like(0.0, self)), _negative(quotient))
    return op.Mul(out, op.Where(flip, number_like(-1.0, self), number_like(1.0, self)))


def remainder(self: Any, other: Any) -> Any:
    """torch's remainder of floats: ``fmod``, moved by the divisor where their signs differ."""
    other = _operand(other, self)
    mod = op.Mod(self, other, fmod=1)
    return op.Where(_opposite_signs(mod, other), op.Add(mod, other), mod)


def _opposite_signs(mod: Any, other: Any) -> Any:
    """``mod != 0 and (other < 0) != (mod < 0)`` (a NaN ``mod`` is not 0, as in C)."""
    zero = number_like(0.0, mod)
    return op.And(op.Not(op.Equal(mod, zero)), op.Xor(op.Less(other, zero), op.Less(mod, zero)))


def atan2(self: Any, other: Any) -> Any:
    """C's ``atan2(y, x)``: ``atan(y / x)``, plus pi with ``y``'s sign where ``x``'s sign bit is
    set; ``y / x`` taken as ``y`` where both are zeros (``atan2(+-0, +0) = +-0``, ``atan2(+-0, -0)
    = +-pi``) and as ``sign(y) * sign(x)`` where both are infinite (+-pi/4, +-3pi/4)."""
    y, x = self, _operand(other, self)
    zero = number_like(0.0, y)
    # Both zeros: y / 1, by the divisor (a Where that picks a -0.0 gives +0 in onnxruntime).
    ratio = op.Div(y, op.Where(op.And(op.Equal(y, zero), op.Equal(x, zero)), number_like(1.0, y), x))
    infinite = op.And(op.IsInf(y), op.IsInf(x))
    ratio = op.Where(infinite, op.Mul(op.Sign(y), op.Sign(x)), ratio)
    half_turn = op.Where(_negative(y), number_like(-math.pi, y), number_like(math.pi, y))
    angle = op.Atan(ratio)
    return op.Where(_negative(x), op.Add(angle, half_turn), angle)


def sign(self: Any) -> Any:
    """-1, 0 or 1; 0 for NaN, as torch's ``(0 < x) - (x < 0)``."""
    if not self.dtype.is_floating_point():
        return core.aten_sign(self)
    return op.Where(op.IsNaN(self), number_like(0.0, self), op.Sign(self))


def heaviside(self: Any, values: Any) -> Any:
    """``values`` where ``x == 0``, else ``x > 0`` (0 for NaN)."""
    if not self.dtype.is_floating_point():
        return core.aten_heaviside(self, values)
    values = _operand(values, self)
    return op.Where(op.Equal(self, number_like(0.0, self)), values, op.CastLike(op.Greater(self, number_like(0.0, self)), self))


def angle(self: Any) -> Any:
    """The angle of a real number: pi below 0, else 0; NaN stays NaN."""
    if not self.dtype.is_floating_point():
        return core.aten_angle(self)
    angle = op.Where(op.Less(self, number_like(0.0, self)), number_like(math.pi, self), number_like(0.0, self))
    return op.Where(op.IsNaN(self), self, angle)


def _operand(value: Any, like: Any) -> Any:
    """A number or a tensor of another dtype as ``like``'s dtype (a number made in that dtype,
    not through float32: ``x % 0.1`` of float64 divides by float64's 0.1)."""
    if isinstance(value, ir.Value):
        return value if value.dtype == like.dtype else op.CastLike(value, like)
    return op.Constant(value=ir.tensor(np.array(value, dtype=like.dtype.numpy())))
