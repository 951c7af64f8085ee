"""torch dtype <-> ONNX element type, and a Python number as a graph value of a tensor's type."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
import torch
from onnxscript.onnx_opset import opset18 as op

TORCH_TO_ONNX: dict[torch.dtype, ir.DataType] = {
    torch.float32: ir.DataType.FLOAT,
    torch.float64: ir.DataType.DOUBLE,
    torch.float16: ir.DataType.FLOAT16,
    torch.bfloat16: ir.DataType.BFLOAT16,
    torch.int8: ir.DataType.INT8,
    torch.int16: ir.DataType.INT16,
    torch.int32: ir.DataType.INT32,
    torch.int64: ir.DataType.INT64,
    torch.uint8: ir.DataType.UINT8,
    torch.bool: ir.DataType.BOOL,
    torch.complex64: ir.DataType.COMPLEX64,
    torch.complex128: ir.DataType.COMPLEX128,
}


def onnx_dtype(dtype: torch.dtype) -> ir.DataType:
    """The ONNX element type of a torch dtype (``ValueError`` for one ONNX cannot hold)."""
    try:
        return TORCH_TO_ONNX[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no ONNX element type") from None


def number_like(value: float, x: Any) -> Any:
    """``value`` as a scalar of ``x``'s element type, rounded once (from a double: a float64
    graph keeps every digit of ``0.1``, a float32 one gets float32's)."""
    return op.CastLike(op.Constant(value=ir.tensor(value, dtype=ir.DataType.DOUBLE)), x)
