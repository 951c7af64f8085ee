"""onnxruntime's tensor type strings: the dtype name and the ONNX type code of each."""

from __future__ import annotations

# "tensor(float)" -> (dtype name as numpy and torch spell it, ONNX TensorProto code)
ORT_TYPES = {
    "tensor(float)": ("float32", 1),
    "tensor(uint8)": ("uint8", 2),
    "tensor(int8)": ("int8", 3),
    "tensor(uint16)": ("uint16", 4),
    "tensor(int16)": ("int16", 5),
    "tensor(int32)": ("int32", 6),
    "tensor(int64)": ("int64", 7),
    "tensor(bool)": ("bool", 9),
    "tensor(float16)": ("float16", 10),
    "tensor(double)": ("float64", 11),
    "tensor(uint32)": ("uint32", 12),
    "tensor(uint64)": ("uint64", 13),
    "tensor(complex64)": ("complex64", 14),
    "tensor(complex128)": ("complex128", 15),
    "tensor(bfloat16)": ("bfloat16", 16),
}

DTYPE_NAMES = {ort: name for ort, (name, _) in ORT_TYPES.items()}  # "tensor(float)" -> "float32"
