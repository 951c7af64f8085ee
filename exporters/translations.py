"""Our ONNX translations of the aten ops whose torchlib translation computes something other
than torch does; each is registered ahead of torchlib's and delegates to it where it agrees.

``scaled_dot_product_attention`` with a boolean mask: torch returns zeros for a query row whose
keys are all masked out (a sequence that is all padding: a warm-up batch of zero masks, a batch
padded with empty rows). torchlib fills masked scores with the dtype's lowest value instead of
-inf, so its softmax spreads such a row evenly over every key and the graph returns the mean of
the values: different numbers from eager, served silently. The fix zeroes exactly those rows
after torchlib's attention, which keeps its pattern intact for onnxruntime's fusions.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention as _torchlib_sdpa
from onnxscript.onnx_opset import opset18 as op


def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> Any:
    """torchlib's attention; with a boolean mask, rows whose mask is all False are zeros, as in torch."""
    out = _torchlib_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is None or attn_mask.dtype != ir.DataType.BOOL:
        return out
    # Any key visible to this query row: (..., L, 1), broadcast over the heads and the value dim.
    visible = op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.FLOAT), op.Constant(value_ints=[-1]), keepdims=1)
    return op.Where(op.Cast(visible, to=ir.DataType.BOOL), out, op.CastLike(op.Constant(value_float=0.0), out))


TABLE: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
}
