"""Our ONNX translations of the aten ops whose torchlib translation computes something other
than torch does; each is registered ahead of torchlib's and delegates to it where it agrees.

``embedding``, ``gather``, ``index_select`` with a negative index: torch raises (``IndexError``:
an id of -1 used as padding, an unfilled slot), ONNX's Gather counts it from the end and the graph
served the last row. Ours turns a negative index into one past the end, which onnxruntime refuses
at run time; the call then runs eagerly and raises torch's own error.

``scaled_dot_product_attention``: torch returns zeros for a query row whose keys are all masked
out (a sequence that is all padding: a warm-up batch of zero masks, a batch padded with empty
rows). torchlib fills boolean-masked scores with the dtype's lowest value instead of -inf, so its
softmax spreads such a row evenly over every key and the graph returns the mean of the values;
with a float mask of -inf its softmax returns NaN: other numbers than eager's either way. Ours
zeroes exactly those rows after torchlib's attention, which keeps its pattern for the fusions.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops.core import aten_gather as _torchlib_gather
from onnxscript.function_libs.torch_lib.ops.core import aten_index_select as _torchlib_index_select
from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention as _torchlib_sdpa
from onnxscript.onnx_opset import opset18 as op


def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> Any:
    """torchlib's attention; rows whose mask hides every key (all False, or all -inf in a float
    mask) are zeros, as in torch."""
    out = _torchlib_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is None:
        return out
    # Whether any key is visible to a query row: (..., L, 1), broadcast over heads and the value dim.
    if attn_mask.dtype == ir.DataType.BOOL:
        best = op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.FLOAT), op.Constant(value_ints=[-1]), keepdims=1)
        visible = op.Cast(best, to=ir.DataType.BOOL)
    else:  # an additive mask: a row of -inf hides everything (torchlib's softmax makes it NaN)
        best = op.ReduceMax(attn_mask, op.Constant(value_ints=[-1]), keepdims=1)
        visible = op.Not(op.IsInf(best, detect_positive=0))
    return op.Where(visible, out, op.CastLike(op.Constant(value_float=0.0), out))


def embedding(weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Any:
    """The rows of ``weight`` (torchlib's Gather), a negative id refused at run time as torch refuses it."""
    return op.Gather(weight, _negative_past_end(indices, weight, 0))


def gather(self: Any, dim: int, index: Any, sparse_grad: bool = False) -> Any:
    """torchlib's gather, a negative index refused at run time as torch refuses it."""
    if len(self.shape) > 0:
        index = _negative_past_end(index, self, dim % len(self.shape))
    return _torchlib_gather(self, dim, index, sparse_grad)


def index_select(self: Any, dim: int, index: Any) -> Any:
    """torchlib's index_select, a negative index refused at run time as torch refuses it."""
    if len(self.shape) > 0:
        index = _negative_past_end(index, self, dim % len(self.shape))
    return _torchlib_index_select(self, dim, index)


def _negative_past_end(index: Any, data: Any, axis: int) -> Any:
    """``index`` with each negative entry replaced by the size of ``data``'s ``axis``: out of range."""
    size = op.CastLike(op.Squeeze(op.Shape(data, start=axis, end=axis + 1)), index)
    fixed = op.Where(op.Less(index, op.CastLike(op.Constant(value_int=0), index)), size, index)
    fixed.shape, fixed.dtype = index.shape, index.dtype  # what torchlib's translation reads of its index
    return fixed


TABLE: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
    torch.ops.aten.embedding.default: embedding,
    torch.ops.aten.gather.default: gather,
    torch.ops.aten.index_select.default: index_select,
}
