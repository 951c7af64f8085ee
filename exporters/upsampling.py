"""Resizes as torch computes them: the output length, and the source index of each output position.

Nearest resizes (``upsample_nearest{1,2,3}d.vec``, ``_upsample_nearest_exact{1,2,3}d.vec``):
torch's source index is ``min(floor((i + offset) * scale), in - 1)`` in float32 with
``scale = float(1.0 / scale_factor)`` (divided in double; ``float(in) / out`` for ``size=``) and
the output size ``floor(double(in) * scale_factor)`` (aten/src/ATen/native/UpSample.h). torchlib's
Resize divides ``i`` by the float32 scale factor instead, and nearest-exact was decomposed into
float32 arithmetic of ``in / (in * scale_factor)``: both land on the other side of an integer at
some sizes only (nearest-exact at 0.7: sizes 7, 14, 23, 28; nearest at 2.3: 31 and up), which the
one verified size cannot show. Ours computes torch's index and gathers along each axis
(scripts/size_sweep.py checks them and the other index arithmetic at every size of a range).

Linear and cubic resizes by a scale factor (``upsample_{bilinear2d,bicubic2d,trilinear3d}.vec``;
``linear`` in 1d is decomposed into size arithmetic, which ``sizes.py`` computes): torchlib's
Resize takes the float32 scale factor, and onnxruntime
computes the output length ``floor(in * scale)`` in float32, where torch computes it in double:
where ``in * scale_factor`` is just below an integer (2.3 at 50, 90, 100; 0.7 at 90, 170) the graph
served one position more than eager. Ours computes torch's length in double; with
``align_corners`` it resizes to that length (torch's source index is then ``(in - 1) / (out - 1)``
of the lengths, as onnxruntime's), else by a float32 scale factor whose length is never shorter
(``_at_least``; torch's source index divides by the scale factor) and cut to it.

A resize that weighs pixels (linear, cubic, antialiased) of an integer image is not exported:
torch computes uint8 resizes with fixed-point weights and rounding of its own, and onnxruntime's
Resize rounds otherwise (a graph verified on one image served others a pixel off). Such calls run
eagerly, saying why. Nearest resizes only pick pixels and are exact either way.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops import nn
from onnxscript.onnx_opset import opset18 as op

from exporters import raising


def _upsample_nearest(exact: bool) -> Callable[..., Any]:
    """``upsample_nearest{1,2,3}d.vec`` (``exact``: ``_upsample_nearest_exact*.vec``) with torch's
    source index: one Gather per spatial axis."""
    def upsample(input: Any, output_size: Sequence[Any] | None = None,
                 scale_factors: Sequence[float] | None = None) -> Any:
        spatial = len(input.shape) - 2
        out = input
        for d in range(spatial):
            scale = None if scale_factors is None else scale_factors[d]
            size = None if output_size is None else output_size[d]
            out = op.Gather(out, _nearest_index(input, 2 + d, size, scale, exact, shortcuts=spatial == 2),
                            axis=2 + d)
        if scale_factors is None or all(scale >= 1 for scale in scale_factors):
            return out
        # A scale below 1 makes a short enough length 0, where torch raises: the graph fails there
        # too, and the call raises eagerly.
        return raising.lengths_nonzero(out, list(range(2, 2 + spatial)), input.dtype)
    return upsample


def _nearest_index(input: Any, axis: int, size: Any, scale_factor: float | None, exact: bool,
                   shortcuts: bool) -> Any:
    """The input index of each output position along ``axis``, as aten/src/ATen/native/UpSample.h
    computes it: ``min(floor((i + offset) * scale), in - 1)`` in float32, where ``scale`` is
    ``float(1.0 / scale_factor)`` (divided in double) when a scale factor is given, else
    ``float(in) / out``; the output size is ``floor(double(in) * scale_factor)``. ONNX's Resize
    divides ``i`` by the scale factor in float32 instead, which lands on the other side of an
    integer at some sizes. ``shortcuts``: torch's CPU kernel for plain nearest in 2-d copies
    where ``out == in`` and halves where ``out == 2 * in``; its 1-d and 3-d kernels do not (a
    scale factor of 2.05 at length 2: ``[0, 0, 0, 1]``, not the shortcut's ``[0, 0, 1, 1]``)."""
    length = op.Squeeze(op.Shape(input, start=axis, end=axis + 1))
    if scale_factor is not None:
        factor = op.Constant(value=ir.tensor(scale_factor, dtype=ir.DataType.DOUBLE))
        out = op.Cast(op.Floor(op.Mul(op.Cast(length, to=ir.DataType.DOUBLE), factor)), to=ir.DataType.INT64)
        scale = op.Constant(value_float=float(np.float32(1.0 / scale_factor)))
    else:
        out = op.Cast(size, to=ir.DataType.INT64) if isinstance(size, ir.Value) else op.Constant(value_int=size)
        scale = op.Div(op.Cast(length, to=ir.DataType.FLOAT), op.Cast(out, to=ir.DataType.FLOAT))
    positions = op.Range(op.Constant(value_int=0), out, op.Constant(value_int=1))
    source = op.Cast(positions, to=ir.DataType.FLOAT)
    if exact:
        source = op.Add(source, op.Constant(value_float=0.5))
    last = op.Sub(length, op.Constant(value_int=1))
    index = op.Min(op.Cast(op.Floor(op.Mul(source, scale)), to=ir.DataType.INT64), last)
    if exact or not shortcuts:
        return index
    halves = op.Div(positions, op.Constant(value_int=2))
    doubled = op.Equal(out, op.Mul(length, op.Constant(value_int=2)))
    return op.Where(op.Equal(out, length), positions, op.Where(doubled, halves, index))


def _scaled(mode: str, torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """A linear or cubic ``.vec`` resize: by a scale factor, torch's length (module docstring);
    to a size, torchlib's."""
    def upsample(input: Any, output_size: Sequence[Any] | None, align_corners: bool,
                 scale_factors: Sequence[float] | None) -> Any:
        if scale_factors is None:
            return torchlib(input, output_size, align_corners, scale_factors)
        axes = list(range(2, len(input.shape)))
        lengths = op.Concat(*(_length(input, axis, scale) for axis, scale in zip(axes, scale_factors)), axis=0)
        options = {"mode": mode, "cubic_coeff_a": -0.75, "nearest_mode": "floor"}  # torch's cubic A
        if align_corners:
            sizes = op.Concat(op.Shape(input, start=0, end=2), lengths, axis=0)
            return op.Resize(input, None, None, sizes, coordinate_transformation_mode="align_corners", **options)
        scales = [1.0, 1.0] + [_at_least(scale) for scale in scale_factors]
        out = op.Resize(input, None, op.Constant(value_floats=scales), None,
                        coordinate_transformation_mode="half_pixel", **options)
        if all(float(np.float32(scale)) == scale for scale in scale_factors):
            return out  # onnxruntime's length is torch's: the scale and its products are exact
        return op.Slice(out, op.Constant(value_ints=[0] * len(axes)), lengths, op.Constant(value_ints=axes))

    return upsample


def _length(input: Any, axis: int, scale_factor: float) -> Any:
    """``floor(double(in) * scale_factor)``, as a 1-element int64 tensor."""
    length = op.Cast(op.Shape(input, start=axis, end=axis + 1), to=ir.DataType.DOUBLE)
    factor = op.Constant(value=ir.tensor(np.array([scale_factor], dtype=np.float64)))
    return op.Cast(op.Floor(op.Mul(length, factor)), to=ir.DataType.INT64)


_LENGTHS = np.arange(1, 2**16 + 1)  # the input lengths ``_at_least`` checks


def _at_least(scale_factor: float) -> float:
    """A float32 scale whose float32 ``in * scale`` (onnxruntime's length) is never shorter than
    torch's double ``in * scale_factor``, for every length up to 65536: the float32 nearest the
    factor where that holds (0.7, 2.3: longer at some lengths, which the Slice cuts), else the one
    just above it (0.65 is short at 180; one above cannot be: an integer is a float32, rounding
    does not cross it). The nearest keeps the source index as close to torch's as it can be."""
    nearest = np.float32(scale_factor)
    ours = np.floor(_LENGTHS.astype(np.float32) * nearest)
    if (ours >= np.floor(_LENGTHS * scale_factor)).all():
        return float(nearest)
    return float(np.nextafter(nearest, np.float32(np.inf)))


def _floats_only(resize: Callable[..., Any]) -> Callable[..., Any]:
    """``resize``, refusing an integer image (module docstring)."""
    def weighed(input: Any, *args: Any, **kwargs: Any) -> Any:
        if not input.dtype.is_floating_point():
            raise NotImplementedError(
                f"a {input.dtype.name.lower()} image resized with weights: torch rounds its fixed-point weights as "
                "onnxruntime's Resize does not (pixels a step off); resize a float image, or use mode='nearest'")
        return resize(input, *args, **kwargs)

    return weighed


TABLE: dict[Any, Callable[..., Any]] = {
    **{getattr(torch.ops.aten, f"upsample_nearest{n}d").vec: _upsample_nearest(exact=False) for n in (1, 2, 3)},
    **{getattr(torch.ops.aten, f"_upsample_nearest_exact{n}d").vec: _upsample_nearest(exact=True) for n in (1, 2, 3)},
    torch.ops.aten.upsample_bilinear2d.vec: _floats_only(_scaled("linear", nn.aten_upsample_bilinear2d_vec)),
    torch.ops.aten.upsample_trilinear3d.vec: _floats_only(_scaled("linear", nn.aten_upsample_trilinear3d_vec)),
    torch.ops.aten.upsample_bicubic2d.vec: _floats_only(_scaled("cubic", nn.aten_upsample_bicubic2d_vec)),
    torch.ops.aten._upsample_bilinear2d_aa.default: _floats_only(nn.aten__upsample_bilinear2d_aa),
    torch.ops.aten._upsample_bicubic2d_aa.default: _floats_only(nn.aten__upsample_bicubic2d_aa),
}
