"""Our ONNX translations of the aten ops whose torchlib translation computes something other
than torch does; each is registered ahead of torchlib's and delegates to it where it agrees.

``embedding``, ``gather``, ``index_select``, the scatters (``scatter``, ``scatter_add``,
``scatter_reduce``, ``index_add``, ``index_copy``) with a negative index (the losses, with a
negative class, in ``losses.py``): torch raises (``IndexError``:
an id of -1 used as padding, an unfilled slot), ONNX's Gather counts it from the end and the graph
served the last row. Ours turns a negative index into one past the end, which onnxruntime refuses
at run time; the call then runs eagerly and raises torch's own error.

``scaled_dot_product_attention``: torch returns zeros for a query row whose keys are all masked
out (a sequence that is all padding: a warm-up batch of zero masks, a batch padded with empty
rows). torchlib fills boolean-masked scores with the dtype's lowest value instead of -inf, so its
softmax spreads such a row evenly over every key and the graph returns the mean of the values;
with a float mask of -inf its softmax returns NaN: other numbers than eager's either way. Ours
zeroes exactly those rows after torchlib's attention, which keeps its pattern for the fusions,
and drops the NaN zeroing torchlib puts after a boolean-masked softmax, which turned a NaN the
inputs carried into zeros. The zeroing is a product with 0 (a float mask's -inf made the lowest
finite value first), which lets a NaN or inf through a hidden row where torch's zero weights
times the values do.

Max and min (``amax``, ``max(dim)``, ``min()``...), max pooling and ``argmax``/``argmin``: torch
propagates a NaN (the max of a window holding one is NaN, argmax points at the first NaN);
onnxruntime's ReduceMax, MaxPool and ArgMax skip it, and a corrupt input was served plausible
numbers. Ours puts the NaN back where the reduced or pooled input held one (integer inputs have
none: torchlib's translation alone).

``div`` of integers with a rounding mode: torchlib divides them in float32, exact only below 2**24
(a pixel index of a 5000x5000 image got the wrong row), and a zero divisor gave INT64_MIN where
torch raises. Ours divides the integers: onnxruntime's integer Div truncates (and fails on a zero
divisor: the call then runs eagerly and raises torch's error); floor is torchlib's exact
``floor_divide``. A divisor of -1 negates instead (``//`` too): onnxruntime's Div traps on the lowest
integer divided by -1 and the process died, where torch wraps.

Resizes (nearest, and linear or cubic by a scale factor) are in ``upsampling.py``; Python
numbers computed from sizes (``int(n * 0.7)``) in ``sizes.py``. Signs, and float floor division
and remainder, are in ``signs.py``; Python numbers in float64 and half-precision graphs
(``x * 0.1``, ``x / 65535.0``) in ``scalars.py``; integer powers in
``integer_power.py``. The log-domain ops (``log_sigmoid``, which
``binary_cross_entropy_with_logits`` decomposes into, ``logaddexp``, ``logaddexp2``,
``logcumsumexp``) are in ``log_domain.py``.

``adaptive_avg_pool2d``: torch's decomposition sums a window unrolled to the length it has at the
traced size; the graph was served at sizes whose windows are longer (output 7: wrong at 9..13,
16..20, 23..27, 30..34). Ours averages torch's windows (``floor(o * in / out)`` to
``ceil((o + 1) * in / out)``) as one matrix product per axis.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops import core, linalg, nn, prims, special
from onnxscript.onnx_opset import opset18 as op

from exporters import integer_power, log_domain, losses, raising, scalars, signs, sizes, upsampling
from exporters.dtypes import number_like


def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> Any:
    """torchlib's attention; rows whose mask hides every key (all False, or all -inf in a float
    mask) are zeros, as in torch."""
    if attn_mask is None:
        return nn.aten_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                    enable_gqa)
    # Whether any key is visible to a query row: (..., L, 1), broadcast over heads and the value dim.
    if attn_mask.dtype == ir.DataType.BOOL:
        visible = op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.FLOAT), op.Constant(value_ints=[-1]), keepdims=1)
    else:  # an additive mask: a row of -inf hides everything
        best = op.ReduceMax(attn_mask, op.Constant(value_ints=[-1]), keepdims=1)
        visible = op.Cast(op.Not(op.IsInf(best, detect_positive=0)), to=ir.DataType.FLOAT)
        # -inf as the dtype's lowest finite value, as torchlib writes a boolean mask: see below.
        lowest = op.Constant(value=ir.tensor(query.dtype.min, dtype=query.dtype))
        attn_mask = op.Where(op.IsInf(attn_mask, detect_positive=0), op.CastLike(lowest, attn_mask), attn_mask)
    out = nn.aten_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _without_nan_zeroing(out)
    # A hidden score is the lowest finite value added, so a hidden row's weights are even and finite
    # unless a score was NaN or +inf; times 0 its output is then torch's own, zero weights times
    # the values: 0, NaN in a column holding a NaN or inf, NaN throughout when a score was. (A
    # product also runs in a quarter of the time of a broadcast Where.)
    return op.Mul(out, op.CastLike(visible, out))


def _without_nan_zeroing(out: Any) -> None:
    """Drop torchlib's ``Where(IsNaN(p), 0, p)`` between the softmax and the product with the
    values (its boolean-mask form writes one): its mask is the dtype's lowest value, so the only
    NaN it meets is one the inputs carried, which torch lets through (a NaN query gave 0 served
    and NaN eager). It also cost two passes over the (batch, heads, query, key) scores. Rows the
    mask hides entirely are zeroed after the product (``scaled_dot_product_attention``)."""
    product = out.producer()
    weights = product.inputs[0].producer() if product is not None and product.op_type == "MatMul" else None
    if weights is None or weights.op_type != "Where" or weights.inputs[0] is None:
        return
    flags = weights.inputs[0].producer()
    if flags is not None and flags.op_type == "IsNaN" and flags.inputs[0] is weights.inputs[2]:
        product.replace_input_with(0, weights.inputs[2])  # the Where and IsNaN, unread, go with dead code


def embedding(weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Any:
    """The rows of ``weight`` (torchlib's Gather), a negative id refused at run time as torch refuses it."""
    return op.Gather(weight, _negative_past_end(indices, weight, 0))


def gather(self: Any, dim: int, index: Any, sparse_grad: bool = False) -> Any:
    """torchlib's gather, a negative index refused at run time as torch refuses it."""
    if len(self.shape) > 0:
        index = _negative_past_end(index, self, dim % len(self.shape))
    return core.aten_gather(self, dim, index, sparse_grad)


def index_select(self: Any, dim: int, index: Any) -> Any:
    """torchlib's index_select, a negative index refused at run time as torch refuses it."""
    if len(self.shape) > 0:
        index = _negative_past_end(index, self, dim % len(self.shape))
    return core.aten_index_select(self, dim, index)


def _index_checked(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """A translation of ``(self, dim, index, ...)`` (scatter, scatter_add, scatter_reduce,
    index_add, index_copy): torchlib's, a negative index refused at run time as torch refuses it
    (ONNX's scatters count it from the end, and the write landed in the last row)."""
    def translated(self: Any, dim: int, index: Any, *rest: Any, **options: Any) -> Any:
        if len(self.shape) > 0:
            index = _negative_past_end(index, self, dim % len(self.shape))
        return torchlib(self, dim, index, *rest, **options)

    return translated


def _no_nan(*tensors: Any) -> Any:
    """Whether none of ``tensors`` holds a NaN (a bool scalar)."""
    found = [_any_nan(t, (), False) for t in tensors]
    return op.Not(found[0] if len(found) == 1 else op.Or(*found))


def unique2(self: Any, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False) -> Any:
    """torchlib's ``_unique2``, declining a float input holding NaN: onnxruntime's Unique merged
    NaN into another value's count, where torch keeps each NaN apart."""
    return _unique_declining_nan(self, core.aten__unique2(self, sorted, return_inverse, return_counts))


def unique_dim(self: Any, dim: int, sorted: bool = True, return_inverse: bool = False,
               return_counts: bool = False) -> Any:
    """torchlib's ``unique_dim``, declining a float input holding NaN (``unique2``)."""
    return _unique_declining_nan(self, core.aten_unique_dim(self, dim, sorted, return_inverse, return_counts))


def _unique_declining_nan(self: Any, out: tuple) -> tuple:
    """``unique``'s values, inverse and counts, each failing the run named ``DECLINES`` where a
    float ``self`` holds NaN."""
    if self.dtype not in _FLOATS:
        return out
    ok = _no_nan(self)
    dtypes = (self.dtype, ir.DataType.INT64, ir.DataType.INT64)
    return tuple(raising.declining(ok, value, dtype) for value, dtype in zip(out, dtypes))


def scatter_reduce(self: Any, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True) -> Any:
    """``scatter_reduce`` (a negative index refused, ``_index_checked``); by ``amax`` or ``amin``,
    declining floats holding NaN: onnxruntime's ScatterElements max and min skip NaN."""
    out = _index_checked(core.aten_scatter_reduce)(self, dim, index, src, reduce, include_self)
    if reduce not in ("amax", "amin") or self.dtype not in _FLOATS:
        return out
    return raising.declining(_no_nan(self, src), out, self.dtype)


def index_add(self: Any, dim: int, index: Any, source: Any, alpha: float = 1) -> Any:
    """``self`` with ``alpha * source`` added at ``index`` along ``dim`` (torchlib has none:
    torch's decomposition into ``index_put`` took a negative index from the end)."""
    if alpha != 1:
        source = op.Mul(source, number_like(float(alpha), source))
    return _scattered_along(self, dim, index, source, "add")


def index_copy(self: Any, dim: int, index: Any, source: Any) -> Any:
    """``self`` with ``source`` written at ``index`` along ``dim``, a negative index refused."""
    return _scattered_along(self, dim, index, source, "none")


def _scattered_along(self: Any, dim: int, index: Any, source: Any, reduction: str) -> Any:
    """ScatterND of ``source``'s slices into ``self``'s along ``dim`` (moved first and back)."""
    rank = len(self.shape)
    if rank == 0:
        return op.ScatterND(self, op.Reshape(index, op.Constant(value_ints=[0])), source, reduction=reduction)
    dim %= rank
    perm = [dim] + [i for i in range(rank) if i != dim]
    back = [perm.index(i) for i in range(rank)]
    rows = op.Unsqueeze(_negative_past_end(index, self, dim), op.Constant(value_ints=[-1]))
    out = op.ScatterND(op.Transpose(self, perm=perm), rows, op.Transpose(source, perm=perm), reduction=reduction)
    return op.Transpose(out, perm=back)


def _negative_past_end(index: Any, data: Any, axis: int) -> Any:
    """``index`` with each negative entry replaced by the size of ``data``'s ``axis``: out of range."""
    size = op.CastLike(op.Squeeze(op.Shape(data, start=axis, end=axis + 1)), index)
    fixed = op.Where(op.Less(index, op.CastLike(op.Constant(value_int=0), index)), size, index)
    fixed.shape, fixed.dtype = index.shape, index.dtype  # what torchlib's translation reads of its index
    return fixed


_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _nan_flags(x: Any) -> Any:
    flags = op.Cast(op.IsNaN(x), to=ir.DataType.FLOAT)
    flags.shape, flags.dtype = x.shape, ir.DataType.FLOAT  # what torchlib's pooling reads of its input
    return flags


def _any_nan(x: Any, axes: Sequence[int], keepdim: bool) -> Any:
    """Whether ``x`` holds a NaN along ``axes`` (all axes when empty), reduced as the op reduces."""
    axes_input = [op.Constant(value_ints=list(axes))] if axes else []
    return op.Cast(op.ReduceMax(_nan_flags(x), *axes_input, keepdims=int(keepdim)), to=ir.DataType.BOOL)


def _with_nan(found: Any, out: Any) -> Any:
    return op.Where(found, op.CastLike(op.Constant(value_float=float("nan")), out), out)


def _nan_along(x: Any, dim: int, keepdim: bool) -> tuple[Any, Any]:
    """Whether ``x`` holds a NaN along ``dim``, and the index of the first (one pass of flags)."""
    flags = _nan_flags(x)
    first = op.ArgMax(flags, axis=dim, keepdims=int(keepdim))
    found = op.Cast(op.ReduceMax(flags, op.Constant(value_ints=[dim]), keepdims=int(keepdim)), to=ir.DataType.BOOL)
    return found, first


def _propagating_reduction(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``amax``/``amin`` (self, dim, keepdim): torchlib's, NaN where the reduced values hold one."""
    def reduction(self: Any, dim: Sequence[int] = (), keepdim: bool = False) -> Any:
        out = torchlib(self, dim, keepdim)
        out = _with_nan(_any_nan(self, dim, keepdim), out) if self.dtype in _FLOATS else out
        return raising.nonempty(self, dim, out)
    return reduction


def vector_norm(self: Any, ord: float = 2.0, dim: Any = None, keepdim: bool = False, dtype: int = -1) -> Any:
    """torchlib's ``linalg_vector_norm``; of order inf or -inf, NaN where the reduced values hold
    one (it is a ReduceMax or ReduceMin of ``|x|``, which skip NaN)."""
    out = linalg.aten_linalg_vector_norm(self, ord, dim, keepdim, dtype)
    if not math.isinf(ord) or self.dtype not in _FLOATS:
        return out
    axes = [] if dim is None else [dim] if isinstance(dim, int) else list(dim)
    return _with_nan(_any_nan(self, axes, keepdim), out)


def _propagating_full(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``max()``/``min()`` of every element: torchlib's, NaN when any element is."""
    def reduction(self: Any) -> Any:
        out = torchlib(self)
        out = _with_nan(_any_nan(self, (), False), out) if self.dtype in _FLOATS else out
        return raising.nonempty(self, None, out)
    return reduction


def _propagating_dim(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``max(dim)``/``min(dim)``: values NaN and indices at the first NaN, as in torch."""
    def reduction(self: Any, dim: int, keepdim: bool = False) -> Any:
        values, indices = torchlib(self, dim, keepdim)
        if self.dtype in _FLOATS and len(self.shape) != 0:
            found, first = _nan_along(self, dim, keepdim)
            values, indices = _with_nan(found, values), op.Where(found, first, indices)
        return raising.nonempty(self, dim, (values, indices))
    return reduction


def _propagating_arg(torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``argmax``/``argmin``: the first NaN's index where there is one, as in torch."""
    def reduction(self: Any, dim: int | None = None, keepdim: bool = False) -> Any:
        out = torchlib(self, dim, keepdim)
        if self.dtype not in _FLOATS or len(self.shape) == 0 or (dim is None and keepdim):
            return out
        flat = dim is None  # torch's argmax of every element: of the flattened tensor
        found, first = _nan_along(op.Reshape(self, op.Constant(value_ints=[-1])) if flat else self,
                                  0 if flat else dim, keepdim)
        return op.Where(found, first, out)
    return reduction


def _windows_with_nan(self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                      dilation: Sequence[int], ceil_mode: bool) -> Any:
    """Which max-pooling windows hold a NaN: where their average is NaN (one pass over the input;
    the same pooling over NaN flags took three and made a pooling-heavy CNN 1.5x slower). A window
    holding both infinities averages to NaN too: torch's max there is +inf, ours NaN."""
    kernel = _pair(kernel_size, ())
    strides, pads = _pair(stride, kernel), _pair(padding, (0, 0)) * 2
    if _pair(dilation, (1, 1)) != [1, 1]:  # AveragePool has no dilation before opset 19: flags, pooled
        return op.Cast(nn.aten_max_pool2d(_nan_flags(self), kernel_size, stride, padding, dilation, ceil_mode),
                       to=ir.DataType.BOOL)
    batched = len(self.shape) == 4
    x = self if batched else op.Unsqueeze(self, op.Constant(value_ints=[0]))  # (C, H, W): one image
    mean = op.AveragePool(x, ceil_mode=int(ceil_mode), kernel_shape=kernel, pads=pads, strides=strides)
    found = op.IsNaN(mean)
    return found if batched else op.Squeeze(found, op.Constant(value_ints=[0]))


def _pair(value: Sequence[int], default: Sequence[int]) -> list[int]:
    """A pooling argument in ONNX's form: torch's ``2`` or ``(2,)`` is ``[2, 2]``; empty, ``default``."""
    return list(value) * (2 // len(value)) if len(value) else list(default)


def max_pool2d(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0, 0),
               dilation: Sequence[int] = (1, 1), ceil_mode: bool = False) -> Any:
    """torchlib's max pooling, NaN for a window that holds one."""
    out = nn.aten_max_pool2d(self, kernel_size, stride, padding, dilation, ceil_mode)
    if self.dtype not in _FLOATS:
        return out
    return _with_nan(_windows_with_nan(self, kernel_size, stride, padding, dilation, ceil_mode), out)


def max_pool2d_with_indices(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0, 0), dilation: Sequence[int] = (1, 1),
                            ceil_mode: bool = False) -> Any:
    """torchlib's max pooling with indices, NaN values for a window that holds one (the indices
    as torchlib has them)."""
    out, indices = nn.aten_max_pool2d_with_indices(self, kernel_size, stride, padding, dilation, ceil_mode)
    if self.dtype not in _FLOATS:
        return out, indices
    return _with_nan(_windows_with_nan(self, kernel_size, stride, padding, dilation, ceil_mode), out), indices


def div_mode(self: Any, other: Any, rounding_mode: str | None = None) -> Any:
    """torchlib's division, but integers with a rounding mode divided as integers."""
    if not isinstance(other, ir.Value) and isinstance(other, int) and not isinstance(other, bool):
        other = op.CastLike(op.Constant(value_int=other), self)
        other.shape, other.dtype = ir.Shape([]), self.dtype  # what torchlib's floor_divide reads
    exact = rounding_mode in ("trunc", "floor") and self.dtype.is_integer() \
        and isinstance(other, ir.Value) and other.dtype == self.dtype
    if rounding_mode == "floor" and self.dtype.is_floating_point():
        return signs.floor_divide(self, other)
    if not exact:
        return core.aten_div_mode(self, other, rounding_mode)
    return _integer_division(self, other, op.Div if rounding_mode == "trunc" else core.aten_floor_divide)


def floor_divide(self: Any, other: Any) -> Any:
    """``//``: integers by ``_integer_division``, floats as torch (``signs.floor_divide``)."""
    if self.dtype.is_integer() and isinstance(other, ir.Value) and other.dtype == self.dtype:
        return _integer_division(self, other, core.aten_floor_divide)
    if self.dtype.is_integer() and isinstance(other, int) and other == -1:  # a negation (see below)
        return op.Neg(self)
    if self.dtype.is_floating_point():
        return signs.floor_divide(self, other)
    return core.aten_floor_divide(self, other)


def _floats(ours: Callable[..., Any], torchlib: Callable[..., Any]) -> Callable[..., Any]:
    """``ours`` for a float tensor, torchlib's for the others."""
    def translated(self: Any, other: Any) -> Any:
        return (ours if self.dtype.is_floating_point() else torchlib)(self, other)

    return translated


def _integer_division(self: Any, other: Any, divide: Callable[[Any, Any], Any]) -> Any:
    """``divide(self, other)`` but by -1, which is a negation: onnxruntime's integer Div traps
    (SIGFPE, the process dies) on the lowest integer divided by -1, which torch wraps to itself."""
    minus_one = op.CastLike(op.Constant(value_int=-1), other)
    flips = op.Equal(other, minus_one)
    divisor = op.Where(flips, op.CastLike(op.Constant(value_int=1), other), other)
    divisor.shape, divisor.dtype = other.shape, other.dtype  # what torchlib's floor_divide reads
    return op.Where(flips, op.Neg(self), divide(self, divisor))


def adaptive_avg_pool2d(self: Any, output_size: Sequence[int]) -> Any:
    """torch's windows, ``floor(o * in / out)`` to ``ceil((o + 1) * in / out)``, averaged as one
    matrix product per axis: the decomposition unrolled the window to the length it had at the
    traced size, and served other sizes whose windows are longer.

    A product's zero weights turn an inf or NaN into NaN in every window of its row and column
    (one inf in a 9x9 input made the whole 3x3 output NaN). Where the product is not finite, the
    finite values are averaged with the others as 0, and a window holding a NaN, an inf, or both
    infinities (counted by the same products over their masks) is NaN, the inf, or NaN, as torch's
    sum of the window gives: ``Where(IsNaN(p) | IsInf(p), exact, p)``, which ``nan_guard`` serves
    as ``p`` alone unless a product is not finite (the masks cost 7x the pooling)."""
    height = _window_weights(self, len(self.shape) - 2, output_size[0])  # (out_h, h)
    width = op.Transpose(_window_weights(self, len(self.shape) - 1, output_size[1]), perm=[1, 0])  # (w, out_w)

    def pooled(x: Any) -> Any:
        return op.MatMul(height, op.MatMul(x, width))  # (..., h, out_w), then (..., out_h, out_w)

    plain = pooled(self)
    nan, above, below = op.IsNaN(self), op.IsInf(self, detect_negative=0), op.IsInf(self, detect_positive=0)
    zero = op.CastLike(op.Constant(value_float=0.0), self)
    average = pooled(op.Where(op.Or(nan, op.Or(above, below)), zero, self))
    held_nan, held_above, held_below = (op.Greater(pooled(op.CastLike(mask, self)), zero)
                                        for mask in (nan, above, below))
    infinity = op.CastLike(op.Constant(value_float=math.inf), self)
    exact = op.Where(held_above, infinity, op.Where(held_below, op.Neg(infinity), average))
    undefined = op.Or(held_nan, op.And(held_above, held_below))  # a NaN, or both infinities
    exact = op.Where(undefined, op.CastLike(op.Constant(value_float=math.nan), self), exact)
    return op.Where(op.Or(op.IsNaN(plain), op.IsInf(plain)), exact, plain)


def _window_weights(x: Any, axis: int, out: int) -> Any:
    """(out, in): 1 / the window's length inside output position o's window along ``axis``, else 0."""
    length = op.Shape(x, start=axis, end=axis + 1)  # (1,)
    outputs = op.Constant(value_ints=list(range(out)))
    count = op.Constant(value_int=out)
    start = op.Unsqueeze(op.Div(op.Mul(outputs, length), count), op.Constant(value_ints=[1]))
    end = op.Unsqueeze(op.Div(op.Add(op.Mul(op.Add(outputs, op.Constant(value_int=1)), length),
                                     op.Constant(value_int=out - 1)), count), op.Constant(value_ints=[1]))
    positions = op.Range(op.Constant(value_int=0), op.Squeeze(length), op.Constant(value_int=1))
    inside = op.And(op.GreaterOrEqual(positions, start), op.Less(positions, end))
    weights = op.Div(op.Cast(inside, to=ir.DataType.FLOAT), op.Cast(op.Sub(end, start), to=ir.DataType.FLOAT))
    return op.CastLike(weights, x)


def clamp(self: Any, min: float | None = None, max: float | None = None) -> Any:
    """torchlib's Clip; with one bound, the other side's infinity kept (below); a bound the trace
    did not fix fails where torch raises (``raising.in_range``)."""
    min, max = raising.in_range(min, self.dtype), raising.in_range(max, self.dtype)
    out = core.aten_clamp(self, min, max)
    if (min is None) == (max is None):
        return out
    return _infinity_kept(self, out, below=min is None)


def clamp_max(self: Any, max_: float) -> Any:
    """torchlib's Clip with an upper bound, ``-inf`` kept."""
    return _infinity_kept(self, core.aten_clamp_max(self, raising.in_range(max_, self.dtype)), below=True)


def clamp_min(self: Any, min_: float) -> Any:
    """torchlib's Clip with a lower bound, ``+inf`` kept."""
    return _infinity_kept(self, core.aten_clamp_min(self, raising.in_range(min_, self.dtype)), below=False)


def log_softmax(self: Any, dim: int, dtype: int = -1) -> Any:
    """torchlib's ``log_softmax``; in float64 written out (``x - max - log(sum(exp(x - max)))``):
    onnxruntime's float64 LogSoftmax gave a row holding NaN numbers besides it, where torch's row
    is NaN throughout (the sum of its exponentials is NaN)."""
    if self.dtype != ir.DataType.DOUBLE or dtype not in (-1, ir.DataType.DOUBLE) or not self.shape:
        return special.aten_special_log_softmax(self, dim, dtype)
    axes = op.Constant(value_ints=[dim])
    shifted = op.Sub(self, op.ReduceMax(self, axes, keepdims=1))
    return op.Sub(shifted, op.Log(op.ReduceSum(op.Exp(shifted), axes, keepdims=1)))


def xlogy(self: Any, other: Any) -> Any:
    """torchlib's ``xlogy``, NaN where ``other`` is: it answered 0 where ``self`` is 0 first
    (``self`` a tensor or a number)."""
    out = special.aten_special_xlogy(self, other)
    return op.Where(op.IsNaN(other), op.CastLike(other, out), out)


def logit(self: Any, eps: float | None = None) -> Any:
    """torchlib's ``logit``, NaN where ``self`` is: with ``eps`` it clips first, and onnxruntime's
    Clip takes NaN to the upper bound (``logit(NaN, eps=1e-6)`` was served 13.8)."""
    out = core.aten_logit(self, eps)
    return out if eps is None else op.Where(op.IsNaN(self), self, out)


def _input_ignored_at_beta_0(torchlib: Callable[..., Any], product: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """``torchlib``'s ``beta * input + alpha * product``, but ``alpha * product`` alone where beta
    is 0: torch ignores ``input`` then (a ``torch.empty()`` buffer may hold NaN), and 0 * NaN is
    NaN (``baddbmm``, ``addbmm``, ``addmv``; torchlib's ``addmm`` does it already)."""

    def translated(self: Any, first: Any, second: Any, beta: Any = 1.0, alpha: Any = 1.0) -> Any:
        if not (isinstance(beta, (int, float)) and beta == 0):
            return torchlib(self, first, second, beta=beta, alpha=alpha)
        out = product(first, second)
        return out if alpha == 1 else op.Mul(out, op.CastLike(op.Constant(value_float=float(alpha)), out))

    return translated


def erfcx(self: Any) -> Any:
    """Not exported: torchlib's ``exp(x^2) * erfc(x)`` is 0 from x >= 4 (erfc underflows) and NaN
    past 9, where torch's is about 0.1 (``log_ndtr`` builds on it). Calls run eagerly."""
    raise NotImplementedError("torchlib's erfcx underflows from x >= 4 (0 and NaN where torch's is about 0.1)")


def _infinity_test(torchlib: Callable[[Any], Any], signs: Sequence[float]) -> Callable[[Any], Any]:
    """``torchlib``'s test for an infinity, but for float64 a comparison with each of ``signs``'
    infinities: torchlib casts to float32 first, where 1e300 is infinite (``isinf(1e300)`` was
    served True, and ``nan_to_num`` made it the largest double)."""

    def translated(self: Any) -> Any:
        if self.dtype != ir.DataType.DOUBLE:
            return torchlib(self)
        infinities = [op.Constant(value=ir.tensor(sign * math.inf, dtype=ir.DataType.DOUBLE)) for sign in signs]
        tests = [op.Equal(self, infinity) for infinity in infinities]
        return tests[0] if len(tests) == 1 else op.Or(*tests)

    return translated


def clamp_tensor(self: Any, min: Any = None, max: Any = None) -> Any:
    """``clamp`` by 0-d tensors (how the exporter writes a clamp by a number in float64 and
    float16): as ``clamp``."""
    out = core.aten_clamp_tensor(self, min, max)
    if (min is None) == (max is None):
        return out
    return _nan_bound(self, max if min is None else min, _infinity_kept(self, out, below=min is None))


def clamp_max_tensor(self: Any, max_: Any) -> Any:
    """``clamp_max`` by a 0-d tensor, ``-inf`` kept."""
    return _nan_bound(self, max_, _infinity_kept(self, core.aten_clamp_max_tensor(self, max_), below=True))


def clamp_min_tensor(self: Any, min_: Any) -> Any:
    """``clamp_min`` by a 0-d tensor, ``+inf`` kept."""
    return _nan_bound(self, min_, _infinity_kept(self, core.aten_clamp_min_tensor(self, min_), below=False))


def _nan_bound(x: Any, bound: Any, out: Any) -> Any:
    """``out`` (a clamp of ``x``), NaN throughout where the bound is: torch's clamp by NaN is NaN,
    infinities too."""
    if x.dtype not in _FLOATS:
        return out
    return op.Where(op.IsNaN(bound), op.CastLike(bound, out), out)


def _infinity_kept(x: Any, clipped: Any, below: bool) -> Any:
    """``clipped``, but ``x`` where it is the infinity on the unbounded side: onnxruntime's Clip
    takes a missing bound as the dtype's lowest (highest) finite value, so ``scores.clamp(max=50)``
    turned a masked -inf into -3.4e38 (a fully masked softmax row: even weights, not NaN)."""
    if x.dtype not in _FLOATS:
        return clipped
    infinity = op.CastLike(op.Constant(value_float=-math.inf if below else math.inf), x)
    return op.Where(op.Equal(x, infinity), x, clipped)


def mean(self: Any, dtype: int = -1) -> Any:
    """torchlib's mean; NaN over nothing (below)."""
    return _nan_when_empty(self, None, core.aten_mean(self, dtype))


def mean_dim(self: Any, dim: Any, keepdim: bool = False, dtype: int = -1) -> Any:
    """torchlib's mean over ``dim``; NaN over nothing (below)."""
    return _nan_when_empty(self, dim, core.aten_mean_dim(self, dim, keepdim, dtype))


def var(inp: Any, dims: Sequence[int] | None, correction: int, output_dtype: int | None = None) -> Any:
    """torchlib's variance, in double for the narrower floats; NaN over nothing (below). It
    subtracts the mean: a float32 mean of values about 1e6 is off by a few hundredths, which
    made the variance 0.8% off; torch accumulates in double."""
    if inp.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return _nan_when_empty(inp, dims, prims.prims_var(inp, dims, correction, output_dtype))
    wide = prims.prims_var(op.Cast(inp, to=ir.DataType.DOUBLE), dims, correction)
    to = output_dtype if output_dtype not in (None, -1) else inp.dtype
    return _nan_when_empty(inp, dims, op.Cast(wide, to=to))


def _nan_when_empty(x: Any, dims: Any, out: Any) -> Any:
    """``out``, NaN where the reduced axes of ``x`` hold no element (a mean loss over the tokens
    a mask selects, none this time): torch's mean and variance of nothing are NaN, onnxruntime's
    0 and -0. Only for axes whose size is not known at export: a static size is never 0 here."""
    rank = len(x.shape)
    if dims is None or (isinstance(dims, Sequence) and not dims):
        axes = list(range(rank))
    else:
        axes = [dims] if isinstance(dims, int) else list(dims)
    axes = [a % rank for a in axes] if rank else []
    if all(isinstance(x.shape[a], int) and x.shape[a] > 0 for a in axes):
        return out
    shape = op.Shape(x)
    count = op.ReduceProd(op.Gather(shape, op.Constant(value_ints=axes)), keepdims=0) if axes else \
        op.Constant(value_int=1)
    nan = op.CastLike(op.Constant(value_float=float("nan")), out)
    return op.Where(op.Equal(count, op.Constant(value_int=0)), nan, out)


TABLE: dict[Any, Callable[..., Any]] = {
    **sizes.TABLE,
    torch.ops.aten.log_sigmoid.default: log_domain.log_sigmoid,
    torch.ops.aten.logaddexp.default: log_domain.logaddexp,
    torch.ops.aten.logaddexp2.default: log_domain.logaddexp2,
    torch.ops.aten.logcumsumexp.default: log_domain.logcumsumexp,
    torch.ops.aten.log1p.default: log_domain.log1p,
    torch.ops.aten.expm1.default: log_domain.expm1,
    torch.ops.aten.scalar_tensor.default: scalars.scalar_tensor,
    **{overload: scalars.in_opmath(torchlib) for overload, torchlib in (
        (torch.ops.aten.add.Tensor, core.aten_add), (torch.ops.aten.sub.Tensor, core.aten_sub),
        (torch.ops.aten.mul.Tensor, core.aten_mul), (torch.ops.aten.div.Tensor, core.aten_div))},
    torch.ops.aten.one_hot.default: raising.one_hot,
    torch.ops.aten.full.default: raising.full,
    torch.ops.aten.full_like.default: raising.full_like,
    torch.ops.aten.new_full.default: raising.new_full,
    torch.ops.aten.masked_fill.Scalar: raising.masked_fill,
    torch.ops.aten.fill.Scalar: raising.fill,
    torch.ops.aten.bincount.default: raising.bincount,
    torch.ops.aten.repeat_interleave.Tensor: raising.repeat_interleave,
    torch.ops.aten.pow.Tensor_Tensor: integer_power.pow_tensor_tensor,
    torch.ops.aten.pow.Tensor_Scalar: integer_power.pow_tensor_scalar,
    torch.ops.aten.pow.Scalar: integer_power.pow_scalar,
    torch.ops.aten.signbit.default: signs.signbit,
    torch.ops.aten.atan2.default: _floats(signs.atan2, core.aten_atan2),
    torch.ops.aten.sign.default: signs.sign,
    torch.ops.aten.sgn.default: signs.sign,
    torch.ops.aten.heaviside.default: signs.heaviside,
    torch.ops.aten.angle.default: signs.angle,
    torch.ops.aten.remainder.Tensor: _floats(signs.remainder, core.aten_remainder),
    torch.ops.aten.remainder.Scalar: _floats(signs.remainder, core.aten_remainder),
    torch.ops.aten.clamp.default: clamp,
    torch.ops.aten.clamp_max.default: clamp_max,
    torch.ops.aten.clamp_min.default: clamp_min,
    torch.ops.aten.clamp.Tensor: clamp_tensor,
    torch.ops.aten.xlogy.Tensor: xlogy,
    torch.ops.aten.xlogy.Scalar_Self: xlogy,
    torch.ops.aten.special_erfcx.default: erfcx,
    torch.ops.aten.baddbmm.default: _input_ignored_at_beta_0(core.aten_baddbmm, op.MatMul),
    torch.ops.aten.addbmm.default: _input_ignored_at_beta_0(
        core.aten_addbmm, lambda a, b: op.ReduceSum(op.MatMul(a, b), op.Constant(value_ints=[0]), keepdims=0)),
    torch.ops.aten.addmv.default: _input_ignored_at_beta_0(core.aten_addmv, op.MatMul),
    torch.ops.aten.logit.default: logit,
    torch.ops.aten.linalg_vector_norm.default: vector_norm,
    torch.ops.aten.log_softmax.int: log_softmax,
    torch.ops.aten.isinf.default: _infinity_test(core.aten_isinf, (1, -1)),
    torch.ops.aten.isposinf.default: _infinity_test(core.aten_isposinf, (1,)),
    torch.ops.aten.isneginf.default: _infinity_test(core.aten_isneginf, (-1,)),
    torch.ops.aten.clamp_max.Tensor: clamp_max_tensor,
    torch.ops.aten.clamp_min.Tensor: clamp_min_tensor,
    torch.ops.aten.mean.default: mean,
    torch.ops.aten.mean.dim: mean_dim,
    torch.ops.prims.var.default: var,
    torch.ops.aten.div.Tensor_mode: div_mode,
    torch.ops.aten.div.Scalar_mode: div_mode,
    torch.ops.aten.floor_divide.default: floor_divide,
    torch.ops.aten.amax.default: _propagating_reduction(core.aten_amax),
    torch.ops.aten.amin.default: _propagating_reduction(core.aten_amin),
    torch.ops.aten.max.default: _propagating_full(core.aten_max),
    torch.ops.aten.min.default: _propagating_full(core.aten_min),
    torch.ops.aten.max.dim: _propagating_dim(core.aten_max_dim),
    torch.ops.aten.min.dim: _propagating_dim(core.aten_min_dim),
    torch.ops.aten.argmax.default: _propagating_arg(core.aten_argmax),
    torch.ops.aten.argmin.default: _propagating_arg(core.aten_argmin),
    torch.ops.aten.max_pool2d.default: max_pool2d,
    torch.ops.aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
    torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
    torch.ops.aten.embedding.default: embedding,
    torch.ops.aten.gather.default: gather,
    torch.ops.aten.index_select.default: index_select,
    torch.ops.aten.scatter.src: _index_checked(core.aten_scatter_src),
    torch.ops.aten.scatter.value: _index_checked(core.aten_scatter_value),
    torch.ops.aten.scatter_add.default: _index_checked(core.aten_scatter_add),
    torch.ops.aten.scatter_reduce.two: scatter_reduce,
    torch.ops.aten._unique2.default: unique2,
    torch.ops.aten.unique_dim.default: unique_dim,
    torch.ops.aten.index_add.default: index_add,
    torch.ops.aten.index_copy.default: index_copy,
    torch.ops.aten.nll_loss.default: losses.nll_loss,
    torch.ops.aten.cross_entropy_loss.default: losses.cross_entropy_loss,
    torch.ops.aten._adaptive_avg_pool2d.default: adaptive_avg_pool2d,
    **upsampling.TABLE,
}
