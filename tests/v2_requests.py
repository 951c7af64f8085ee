"""Malformed KServe v2 requests, each with the status and message it must get back.

Shared by the protocol's unit tests and the server's HTTP tests. The model they address has the
inputs of ``Scorer`` in test_kserve_server.py: ``x`` FP32 [-1, 4] and ``ids`` INT64 [-1], sharing
dim 0; outputs ``scores`` FP32 [-1, 3] and ``best`` INT64 [-1].
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

from clika_runtime.base.specs import TensorInfo

INPUTS = [TensorInfo("x", "float32", ("x_dim0", 4)), TensorInfo("ids", "int64", ("x_dim0",))]
OUTPUTS = [TensorInfo("scores", "float32", ("x_dim0", 3)), TensorInfo("best", "int64", ("x_dim0",))]
MAX_ELEMENTS = 2**20


def x_entry(rows: int = 2, **changes: Any) -> dict[str, Any]:
    return {"name": "x", "shape": [rows, 4], "datatype": "FP32", "data": [0.5] * (4 * rows), **changes}


def ids_entry(rows: int = 2, **changes: Any) -> dict[str, Any]:
    return {"name": "ids", "shape": [rows], "datatype": "INT64", "data": list(range(rows)), **changes}


def json_body(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def binary_body(
    x_bytes: bytes, ids_bytes: bytes, *, x_size: int | None = None, ids_size: int | None = None, trailing: bytes = b""
) -> tuple[bytes, str]:
    """A binary-extension body: (body, Inference-Header-Content-Length)."""
    header = json.dumps({"inputs": [
        {"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": x_size or len(x_bytes)}},
        {"name": "ids", "shape": [2], "datatype": "INT64", "parameters": {"binary_data_size": ids_size or len(ids_bytes)}},
    ]}).encode()
    return header + x_bytes + ids_bytes + trailing, str(len(header))


class Bad(NamedTuple):
    id: str
    body: bytes
    header_length: str | None
    status: int
    match: str  # regex the error message must contain


X_BYTES = np.zeros((2, 4), np.float32).tobytes()
NESTED = json.loads("[" * 900 + "]" * 900)  # str() of it, deep in a server's stack, passes Python's recursion limit
IDS_BYTES = np.arange(2, dtype=np.int64).tobytes()

BAD_REQUESTS = [
    Bad("bad_json", b"{not json", None, 400, r"not valid JSON"),
    Bad("not_an_object", b"[1, 2]", None, 400, r"expected a JSON object with a list of 'inputs'"),
    Bad("unknown_input", json_body([x_entry(), ids_entry(), {"name": "z"}]), None, 400,
        r"unknown input 'z'; the model's inputs are \['x', 'ids'\]"),
    Bad("missing_input", json_body([x_entry()]), None, 400, r"missing input\(s\) \['ids'\]"),
    Bad("duplicate_input", json_body([x_entry(), x_entry(), ids_entry()]), None, 400, r"input 'x' is given twice"),
    Bad("wrong_datatype", json_body([x_entry(datatype="FP64"), ids_entry()]), None, 400,
        r"input 'x': expected datatype FP32, got 'FP64'"),
    Bad("wrong_rank", json_body([x_entry(shape=[8]), ids_entry()]), None, 400,
        r"input 'x': expected rank 2 \[-1, 4\], got shape \[8\]"),
    Bad("wrong_static_size", json_body([x_entry(shape=[1, 8]), ids_entry()]), None, 400,
        r"input 'x' axis 1: expected size 4 \[-1, 4\], got 8"),
    Bad("negative_size", json_body([x_entry(shape=[-2, 4]), ids_entry()]), None, 400,
        r"input 'x': 'shape' must be a list of sizes >= 0, got \[-2, 4\]"),
    Bad("shared_dim_disagrees", json_body([x_entry(2), ids_entry(3)]), None, 400,
        r"input 'ids' axis 0: size 3, but input 'x' axis 0 has 2 and the graph declares both as dim 'x_dim0'"),
    Bad("too_many_elements", json_body([x_entry(shape=[2**40, 4]), ids_entry()]), None, 400,
        r"input 'x': shape \[1099511627776, 4\] has 4398046511104 elements, over the server's limit"),
    Bad("json_data_short", json_body([x_entry(data=[1.0] * 7), ids_entry()]), None, 400,
        r"input 'x': shape \[2, 4\] holds 8 elements, 'data' has 7"),
    Bad("json_data_ragged", json_body([x_entry(data=[[1.0] * 4, [1.0] * 3]), ids_entry()]), None, 400,
        r"input 'x': 'data' is a ragged nested list"),
    Bad("json_data_missing", json_body([x_entry(data=None), ids_entry()]), None, 400,
        r"input 'x': expected 'data' \(a list\) or a binary_data_size parameter"),
    Bad("json_floats_for_ints", json_body([x_entry(), ids_entry(data=[1.5, 2])]), None, 400,
        r"input 'ids': INT64 data must be integers in \[-\d+, \d+\], got floats"),
    Bad("json_strings", json_body([x_entry(data=["a"] * 8), ids_entry()]), None, 400,
        r"input 'x': FP32 data must be numbers, got strings"),
    Bad("json_int_overflow", json_body([x_entry(), ids_entry(data=[2**63, 1])]), None, 400,
        r"input 'ids': INT64 data must be integers in \[-9223372036854775808, 9223372036854775807\], "
        r"got integers outside that range"),
    Bad("unknown_output", json_body([x_entry(), ids_entry()], outputs=[{"name": "nope"}]), None, 400,
        r"unknown output 'nope'; the model's outputs are \['scores', 'best'\]"),
    Bad("classification", json_body([x_entry(), ids_entry()], outputs=[{"name": "best", "parameters": {"classification": 2}}]),
        None, 400, r"output 'best': the classification extension is not supported"),
    Bad("binary_size_mismatch", *binary_body(X_BYTES, IDS_BYTES, x_size=28), 400,
        r"input 'x': shape \[2, 4\] of FP32 takes 32 bytes, binary_data_size says 28"),
    Bad("binary_past_end", *binary_body(X_BYTES, IDS_BYTES[:8], ids_size=16), 400,
        r"input 'ids': binary_data_size 16 runs past the body \(8 bytes left\)"),
    Bad("binary_trailing_bytes", *binary_body(X_BYTES, IDS_BYTES, trailing=b"1234"), 400,
        r"binary data: the inputs take 48 bytes, the body has 52 after the header"),
    Bad("header_length_not_a_number", binary_body(X_BYTES, IDS_BYTES)[0], "abc", 400,
        r"Inference-Header-Content-Length: expected a byte count, got 'abc'"),
    Bad("header_length_past_body", binary_body(X_BYTES, IDS_BYTES)[0], "999999", 400,
        r"Inference-Header-Content-Length is 999999, but the body has \d+ bytes"),
    # Hostile ones: each once escaped as an exception that is not a ProtocolError (a 500 with a log).
    Bad("header_length_unicode_digit", binary_body(X_BYTES, IDS_BYTES)[0], "\u00b2", 400,
        r"Inference-Header-Content-Length: expected a byte count, got '\u00b2'"),
    Bad("header_length_5000_digits", binary_body(X_BYTES, IDS_BYTES)[0], "9" * 5000, 400,
        r"Inference-Header-Content-Length: expected a byte count, got '9{80}\.\.\.'"),
    Bad("json_nested_100000_deep", b"[" * 100_000, None, 400, r"request header: JSON nested too deep"),
    Bad("input_name_a_list", json_body([{"name": ["x"]}, ids_entry()]), None, 400,
        r"unknown input \['x'\]; the model's inputs are \['x', 'ids'\]"),
    Bad("input_name_nested_900_deep", json_body([{"name": NESTED}, ids_entry()]), None, 400,
        r"unknown input \[\[\[\[\.\.\.\]\]\]\]; the model's inputs"),
    Bad("shape_of_100000_dims", json_body([x_entry(shape=[1] * 100_000), ids_entry()]), None, 400,
        r"input 'x': expected rank 2 \[-1, 4\], got shape \[1, 1, 1, 1, 1, 1, 1, 1, \.\.\.\]$"),
]
