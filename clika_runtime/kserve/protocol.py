"""The KServe v2 / Triton HTTP inference protocol, checked against one graph's declared inputs.

Pure Python and numpy (no Ray, no web framework), so every rule is unit-tested without a server.
Requests come as JSON tensors (``name``, ``shape``, ``datatype``, ``data``) or with the binary
tensor data extension, which tritonclient uses by default: the body is a JSON header of
``Inference-Header-Content-Length`` bytes followed by the raw little-endian bytes of each input that
carries a ``binary_data_size`` parameter, in the order the inputs are listed. Outputs go back the
same way when asked (``binary_data`` per output, ``binary_data_output`` for all).

Every refusal is a ``ProtocolError`` whose message names the input and says expected vs got; the
server answers it as ``{"error": message}`` with the error's HTTP status. Paths, methods and the
body's size are ``routes``' business.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from clika_runtime.base.errors import ProtocolError, ServeError
from clika_runtime.base.specs import TensorInfo
from clika_runtime.base.version import VERSION

# numpy's dtype name -> the v2 protocol's datatype. bfloat16 (numpy cannot hold it), strings and
# complex numbers have no entry: a graph with one of them is refused at startup.
V2_DATATYPES = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}
HEADER_LENGTH = "inference-header-content-length"
MODEL_VERSION = "1"
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# A byte count in a header: ASCII digits only (str.isdigit takes '²', which int() refuses), and
# few enough of them for any body a server takes.
_BYTE_COUNT = re.compile(r"[0-9]{1,15}")
_BRIEF = reprlib.Repr()  # client values in errors: a few levels and items, never a deep or long repr
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxstring, _BRIEF.maxother = 3, 8, 4, 60, 60


@dataclass(frozen=True)
class Tensor:
    """A graph input or output in the protocol's terms."""

    name: str
    datatype: str  # "FP32", "INT64", ...
    dtype: np.dtype
    shape: tuple[int | str | None, ...]  # an int per static axis; the dim's name (or None) per dynamic axis

    @property
    def v2_shape(self) -> list[int]:
        """The shape as the protocol writes it: -1 for each dynamic axis."""
        return [d if isinstance(d, int) else -1 for d in self.shape]


@dataclass(frozen=True)
class Model:
    """What the server knows of the graph it serves: its name and declared inputs and outputs."""

    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    @classmethod
    def from_graph(cls, name: str, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo]) -> "Model":
        """Describe a loaded graph (``ServedGraph.inputs`` / ``.outputs``); ``ServeError`` for a
        name the URL cannot carry or a dtype the protocol cannot."""
        check_model_name(name)
        return cls(name, tuple(_tensor("input", t) for t in inputs), tuple(_tensor("output", t) for t in outputs))


@dataclass(frozen=True)
class InferRequest:
    """A parsed, checked inference request."""

    id: str | None
    inputs: dict[str, np.ndarray]  # every graph input, in the graph's order
    outputs: list[tuple[str, bool]]  # (output name, answer in binary) in the order asked


def check_model_name(name: str) -> None:
    """A model name travels in URLs: letters, digits, ``_``, ``.`` and ``-`` only."""
    if not _MODEL_NAME.match(name):
        raise ServeError(f"model name {name!r}: use letters, digits, '_', '.' and '-' only (it goes in URLs)")


def _tensor(kind: str, info: TensorInfo) -> Tensor:
    if info.dtype not in V2_DATATYPES:
        raise ServeError(
            f"graph {kind} {info.name!r} is {info.dtype}, which the v2 server cannot carry "
            f"(supported: {', '.join(V2_DATATYPES)})"
        )
    return Tensor(info.name, V2_DATATYPES[info.dtype], np.dtype(info.dtype), tuple(info.shape))


def byte_count(text: str, header: str) -> int:
    """A header's byte count, or a ``ProtocolError`` (400) naming the header."""
    if not _BYTE_COUNT.fullmatch(text):
        raise ProtocolError(f"{header}: expected a byte count, got {short(text)!r}")
    return int(text)


def brief(value: Any) -> str:
    """A client-given value (of any JSON type) echoed in an error: a bounded repr, safe for
    values nested a thousand levels deep, where ``str`` would recurse past Python's limit."""
    return _BRIEF.repr(value)


def short(text: str, limit: int = 80) -> str:
    """Client-given text echoed in an error, cut so a hostile client cannot make errors huge."""
    return text if len(text) <= limit else text[:limit] + "..."


def parse_infer(model: Model, body: bytes, header_length: str | None, *, max_elements: int) -> InferRequest:
    """Parse and check an inference request body against the model's inputs and outputs.

    ``header_length`` is the ``Inference-Header-Content-Length`` header (``None`` when the body is
    JSON only). No tensor of more than ``max_elements`` elements is allocated.
    """
    header, binary = _split_body(body, header_length)
    doc = _load_json(header)
    inputs = _parse_inputs(model, doc, binary, max_elements)
    return InferRequest(_request_id(doc), inputs, _requested_outputs(model, doc))


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    size = byte_count(header_length, "Inference-Header-Content-Length")
    if size > len(body):
        raise ProtocolError(f"Inference-Header-Content-Length is {size}, but the body has {len(body)} bytes")
    return body[:size], memoryview(body)[size:]


def _load_json(header: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(header)
    except UnicodeDecodeError:
        raise ProtocolError("request header: not UTF-8 JSON") from None
    except ValueError as e:
        raise ProtocolError(f"request header: not valid JSON ({short(str(e))})") from None
    except RecursionError:  # '[' * 100000: json's parser recurses per level
        raise ProtocolError("request header: JSON nested too deep") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise ProtocolError("request header: expected a JSON object with a list of 'inputs'")
    return doc


def _request_id(doc: Mapping[str, Any]) -> str | None:
    value = doc.get("id")
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"'id': expected a string, got {type(value).__name__}")
    return value


def _parse_inputs(model: Model, doc: Mapping[str, Any], binary: memoryview, max_elements: int) -> dict[str, np.ndarray]:
    declared = {t.name: t for t in model.inputs}
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for position, entry in enumerate(doc["inputs"]):
        if not isinstance(entry, dict):
            raise ProtocolError(f"inputs[{position}]: expected an object with name, shape, datatype and data")
        name = entry.get("name")
        if not isinstance(name, str) or name not in declared:
            raise ProtocolError(f"unknown input {brief(name)}; the model's inputs are {list(declared)}")
        if name in arrays:
            raise ProtocolError(f"input {name!r} is given twice")
        tensor = declared[name]
        shape = _checked_shape(tensor, entry, max_elements)
        size = _binary_size(tensor, entry)
        if size is None:
            arrays[name] = _from_json(tensor, shape, entry.get("data"))
        else:
            arrays[name] = _from_binary(tensor, shape, binary, offset, size)
            offset += size
    missing = [n for n in declared if n not in arrays]
    if missing:
        raise ProtocolError(f"missing input(s) {missing}; the model's inputs are {list(declared)}")
    if offset != len(binary):
        raise ProtocolError(f"binary data: the inputs take {offset} bytes, the body has {len(binary)} after the header")
    _check_shared_dims(model, arrays)
    return {n: arrays[n] for n in declared}


def _checked_shape(tensor: Tensor, entry: Mapping[str, Any], max_elements: int) -> tuple[int, ...]:
    name, shape, datatype = tensor.name, entry.get("shape"), entry.get("datatype")
    if datatype != tensor.datatype:
        raise ProtocolError(f"input {name!r}: expected datatype {tensor.datatype}, got {brief(datatype)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"input {name!r}: 'shape' must be a list of sizes >= 0, got {brief(shape)}")
    if len(shape) != len(tensor.shape):
        raise ProtocolError(f"input {name!r}: expected rank {len(tensor.shape)} {tensor.v2_shape}, got shape {brief(shape)}")
    for axis, (want, got) in enumerate(zip(tensor.shape, shape)):
        if isinstance(want, int) and want != got:
            raise ProtocolError(f"input {name!r} axis {axis}: expected size {want} {tensor.v2_shape}, got {got}")
    count = math.prod(shape)
    if count > max_elements:
        raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, over the server's limit of {max_elements}")
    if max(shape, default=0) > max_elements:  # [0, 2**62] holds no element, but numpy cannot make it
        raise ProtocolError(f"input {name!r}: shape {shape} has a size over the server's limit of {max_elements}")
    return tuple(shape)


def _binary_size(tensor: Tensor, entry: Mapping[str, Any]) -> int | None:
    parameters = entry.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError(f"input {tensor.name!r}: 'parameters' must be an object")
    size = parameters.get("binary_data_size")
    if size is not None and not (type(size) is int and size >= 0):
        raise ProtocolError(f"input {tensor.name!r}: binary_data_size must be a byte count, got {brief(size)}")
    return size


def _from_json(tensor: Tensor, shape: tuple[int, ...], data: Any) -> np.ndarray:
    name, count = tensor.name, math.prod(shape)
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: expected 'data' (a list) or a binary_data_size parameter")
    try:
        parsed = np.array(data)
    except ValueError:
        raise ProtocolError(f"input {name!r}: 'data' is a ragged nested list") from None
    if parsed.size != count:
        raise ProtocolError(f"input {name!r}: shape {list(shape)} holds {count} elements, 'data' has {parsed.size}")
    if count:
        _check_json_values(tensor, parsed)
    return parsed.astype(tensor.dtype).reshape(shape)


def _check_json_values(tensor: Tensor, parsed: np.ndarray) -> None:
    """JSON values must fit the datatype: integers in range for integer inputs, numbers for float
    inputs, true/false for BOOL (numpy would convert any of these silently)."""
    kind = parsed.dtype.kind
    if tensor.dtype.kind == "b":
        if kind != "b":
            raise ProtocolError(f"input {tensor.name!r}: BOOL data must be true/false, got {_kind_name(parsed)}")
    elif tensor.dtype.kind == "f":
        if kind not in "iuf":
            raise ProtocolError(f"input {tensor.name!r}: {tensor.datatype} data must be numbers, got {_kind_name(parsed)}")
    else:
        limits = np.iinfo(tensor.dtype)
        if kind not in "iu" or parsed.min() < limits.min or parsed.max() > limits.max:
            raise ProtocolError(
                f"input {tensor.name!r}: {tensor.datatype} data must be integers in [{limits.min}, {limits.max}], "
                f"got {_kind_name(parsed, limits)}"
            )


def _kind_name(array: np.ndarray, limits: np.iinfo | None = None) -> str:
    kind = array.dtype.kind
    if limits is not None and kind in "iu":
        return "integers outside that range"
    # numpy reads a list that mixes integers past int64 with others as floats: large whole floats
    if limits is not None and kind == "f" and np.all(np.mod(array, 1) == 0) and np.abs(array).max() >= 2**53:
        return "integers outside that range"
    names = {"b": "true/false", "i": "integers", "u": "integers", "f": "floats", "U": "strings"}
    return names.get(kind, "values that are not numbers (or integers past 64 bits)")


def _from_binary(tensor: Tensor, shape: tuple[int, ...], binary: memoryview, offset: int, size: int) -> np.ndarray:
    name, count = tensor.name, math.prod(shape)
    need = count * tensor.dtype.itemsize
    if size != need:
        raise ProtocolError(
            f"input {name!r}: shape {list(shape)} of {tensor.datatype} takes {need} bytes, binary_data_size says {size}"
        )
    if offset + size > len(binary):
        raise ProtocolError(
            f"input {name!r}: binary_data_size {size} runs past the body ({len(binary) - offset} bytes left)"
        )
    # The wire is little-endian; so are the hosts this serves on, so this is a view, not a copy.
    array = np.frombuffer(binary, dtype=tensor.dtype.newbyteorder("<"), count=count, offset=offset).reshape(shape)
    if tensor.dtype.kind == "b" and count and array.view(np.uint8).max() > 1:
        raise ProtocolError(f"input {name!r}: BOOL bytes must be 0 or 1")
    return array


def _check_shared_dims(model: Model, arrays: Mapping[str, np.ndarray]) -> None:
    """Axes the graph names alike must have one size across the request's inputs."""
    seen: dict[str, tuple[str, int, int]] = {}
    for tensor in model.inputs:
        for axis, dim in enumerate(tensor.shape):
            if not isinstance(dim, str):
                continue
            size = arrays[tensor.name].shape[axis]
            first = seen.setdefault(dim, (tensor.name, axis, size))
            if first[2] != size:
                raise ProtocolError(
                    f"input {tensor.name!r} axis {axis}: size {size}, but input {first[0]!r} axis {first[1]} "
                    f"has {first[2]} and the graph declares both as dim {dim!r}"
                )


def _requested_outputs(model: Model, doc: Mapping[str, Any]) -> list[tuple[str, bool]]:
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError("'parameters' must be an object")
    binary = _flag(parameters, "binary_data_output", "request")
    entries = doc.get("outputs")
    if entries is None:
        return [(t.name, binary) for t in model.outputs]
    if not isinstance(entries, list):
        raise ProtocolError("'outputs' must be a list of objects with a name")
    known = [t.name for t in model.outputs]
    wanted = []
    for entry in entries:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in known:
            raise ProtocolError(f"unknown output {brief(name)}; the model's outputs are {known}")
        options = entry.get("parameters") or {}
        if not isinstance(options, dict):
            raise ProtocolError(f"output {name!r}: 'parameters' must be an object")
        if "classification" in options:
            raise ProtocolError(f"output {name!r}: the classification extension is not supported")
        wanted.append((name, _flag(options, "binary_data", f"output {name!r}", default=binary)))
    return wanted


def _flag(parameters: Mapping[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}: {key} must be true or false, got {brief(value)}")
    return value


def encode_infer(model: Model, request: InferRequest, outputs: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and headers for the outputs the request asked for, binary where asked."""
    entries, blobs = [], []
    for name, binary in request.outputs:
        array = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": V2_DATATYPES[array.dtype.name], "shape": list(array.shape)}
        if binary:
            blob = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model.name, "model_version": MODEL_VERSION, "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream", HEADER_LENGTH: str(len(header)),
    }


def model_metadata(model: Model) -> dict[str, Any]:
    """``GET /v2/models/{name}``: name, versions, platform, inputs and outputs (-1 for dynamic axes)."""

    def describe(tensors: Sequence[Tensor]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": t.v2_shape} for t in tensors]

    return {
        "name": model.name, "versions": [MODEL_VERSION], "platform": "onnxruntime_onnx",
        "inputs": describe(model.inputs), "outputs": describe(model.outputs),
    }


def server_metadata() -> dict[str, Any]:
    """``GET /v2``: the server's name, version and protocol extensions."""
    return {"name": "clika_runtime", "version": VERSION, "extensions": ["binary_tensor_data", "statistics"]}
