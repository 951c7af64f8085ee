"""The rules a Triton model repository entry follows, shared by the writer (``writer``) and the
checker (``checker``): the files' names, the data types Triton's onnxruntime backend takes, and
the problems of a graph's inputs and outputs, batching, batch-size ranges and weight references.

Every problem here is a rule Triton enforces when it loads the model, or one without which its
batcher would return wrong answers; the comment at each rule says where it comes from, in
Triton's sources as of release 26.06: "core" is github.com/triton-inference-server/core, "ort" is
.../onnxruntime_backend, "docs" is .../server/docs/user_guide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import onnx

from clika_runtime.base.errors import GraphFileError
from clika_runtime.format import metadata
from clika_runtime.format.graphfile import escapes
from clika_runtime.format.interface import interface
from clika_runtime.guards.conditions import render
from clika_runtime.guards.guard import Guard
from clika_runtime.triton.enforced import PREFIX, enforced, words

PLATFORM = "onnxruntime_onnx"
CONFIG_FILE = "config.pbtxt"
MODEL_FILE = "model.onnx"

_T = onnx.TensorProto
# ONNX element type -> Triton data type, as the onnxruntime backend converts them (ort
# src/onnxruntime_utils.cc, ConvertFromOnnxDataType). Complex, float8, int4 and float4 are absent:
# the backend has no Triton type for them and refuses the model. bfloat16 arrived in release 26.03
# (ort #335, "Enable bfloat16 I/O tensor dtype"); the table in docs/model_configuration.md predates it.
TRITON_TYPES = {
    _T.BOOL: "TYPE_BOOL", _T.UINT8: "TYPE_UINT8", _T.UINT16: "TYPE_UINT16", _T.UINT32: "TYPE_UINT32",
    _T.UINT64: "TYPE_UINT64", _T.INT8: "TYPE_INT8", _T.INT16: "TYPE_INT16", _T.INT32: "TYPE_INT32",
    _T.INT64: "TYPE_INT64", _T.FLOAT16: "TYPE_FP16", _T.BFLOAT16: "TYPE_BF16", _T.FLOAT: "TYPE_FP32",
    _T.DOUBLE: "TYPE_FP64", _T.STRING: "TYPE_STRING",
}


@dataclass(frozen=True)
class Tensor:
    """A graph input or output (``role``): ``shape`` None when the graph gives none; ints static,
    strs dynamic (the dim's name, ``""`` when unnamed)."""

    role: str
    name: str
    elem_type: int
    shape: tuple[int | str, ...] | None

    @property
    def where(self) -> str:
        return f"{self.role} '{self.name}'"

    @property
    def dims(self) -> tuple[int, ...]:
        """Triton's form: -1 for a dynamic dim."""
        return tuple(d if isinstance(d, int) else -1 for d in self.shape or ())


def declared_tensors(model_proto: Any) -> list[Tensor]:
    """Graph inputs (initializers left out, as onnxruntime does) then outputs."""
    declared = interface(model_proto)
    return [Tensor("input", *p) for p in declared.inputs] + [Tensor("output", *p) for p in declared.outputs]


def default_name(graph_name: str) -> str:
    """The graph name (a function's own name, not its ``outer.<locals>.`` prefix) kept to characters
    that every file system and a URL path segment (KServe v2's ``/v2/models/<name>``) take as they are."""
    own = graph_name.rpartition(".<locals>.")[2]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", own).strip("._-") or "model"


def name_problems(name: str) -> list[str]:
    # core model_repository_manager.cc, ValidateModelName: "Model name cannot be empty" once
    # whitespace is trimmed, and "must not contain path traversal characters" ('..' or '/').
    # The same file requires the directory name to equal the config's name ("directory name must
    # equal model name"), so the name is one directory name: '.' and NUL cannot be.
    if not name.strip():
        return [f"model name {name!r}: Triton refuses an empty or all-space name"]
    if name in (".", "..") or "/" in name or "\0" in name:
        return [f"model name {name!r}: Triton needs one directory name (no '/', not '.' or '..'), "
                f"e.g. {default_name(name)!r}"]
    if not name.isprintable():  # a newline in a folder name and in config.pbtxt: no client can name it
        return [f"model name {name!r}: control characters (a newline, a tab) make a name no client can "
                f"send; e.g. {default_name(name)!r}"]
    return []


def tensor_problems(tensors: list[Tensor], max_batch_size: int) -> list[str]:
    problems = []
    for t in tensors:
        if not t.name:  # core ValidateIOShape: "must specify 'name'"
            problems.append(f"an {t.role} has an empty name: Triton addresses inputs and outputs by name")
        if t.elem_type not in TRITON_TYPES:
            problems.append(
                f"{t.where} is {_T.DataType.Name(t.elem_type).lower()}, which Triton's onnxruntime backend does "
                f"not take (it takes {', '.join(TRITON_TYPES.values())}): cast it in the model"
            )
        if t.shape is None:  # ort reports no dims, and then treats the tensor as a scalar
            problems.append(f"{t.where} has no shape in the graph: give it one (Triton would take it for a scalar)")
        elif 0 in t.shape:  # core ValidateIOShape: "dimension must be integer >= 1, or -1"
            problems.append(f"{t.where} has a static dim of size 0 {_shape(t)}: Triton takes dims >= 1 or -1")
    return problems + (_batch_problems(tensors) if max_batch_size > 0 else [])


def _batch_problems(tensors: list[Tensor]) -> list[str]:
    """Triton's batcher stacks requests along dim 0 of every input and splits every output along its
    dim 0. The onnxruntime backend checks that each dim 0 is dynamic (ort CompareDimsSupported: "the
    first dimension must be -1"); batching is right only if they are all the same dim, the batch."""
    problems, batch = [], None
    for t in tensors:
        if t.shape is None:
            continue
        head = f"max_batch_size > 0 but {t.where}"
        if not t.shape:
            what = "a lifted Python number" if t.role == "input" else "a scalar"
            problems.append(f"{head} is rank 0 ({what}), which cannot be batched along dim 0: use max_batch_size=0")
        elif isinstance(t.shape[0], int):
            problems.append(f"{head} has a static dim 0 {_shape(t)}: {_make_dynamic(t)}")
        elif not t.shape[0]:
            problems.append(f"{head} has an unnamed dynamic dim 0, which cannot be shown to be the batch dim: "
                            f"{_make_dynamic(t)}")
        elif batch is None:
            batch = t
        elif t.shape[0] != batch.shape[0]:
            problems.append(
                f"{head} has dim 0 '{t.shape[0]}', not the batch dim '{batch.shape[0]}' of {batch.where}: "
                + (f"declare them one dim, with equal names in signature or dynamic_axes (e.g. "
                   f"{{'{batch.name}': {{0: 'batch'}}, '{t.name}': {{0: 'batch'}}}})" if t.role == "input"
                   else "Triton would split it as if it were; use max_batch_size=0")
            )
    return problems + (_batch_beyond_dim0(tensors, batch.shape[0]) if batch is not None else [])


def _batch_beyond_dim0(tensors: list[Tensor], batch: str) -> list[str]:
    """A tensor that also uses the batch dim past dim 0 (``x @ x.T``: ``[batch, batch]``) mixes the
    rows of requests Triton stacked together: each would be answered with the others' rows."""
    return [f"max_batch_size > 0 but {t.where} {_shape(t)} uses the batch dim '{batch}' past dim 0: requests "
            "batched together would see each other's rows; use max_batch_size=0"
            for t in tensors if t.shape and batch in t.shape[1:]]


def range_problems(model_proto: Any, tensors: list[Tensor], max_batch_size: int) -> list[str]:
    """Batch sizes Triton sends (1 to ``max_batch_size``) that the graph's guard does not take
    for its batch dim (a branch on the batch size traced one way: ``x.shape[0] > 4``), and size
    conditions that read the batch dim: Triton does not read the guard, so its batcher would run
    the graph on batches it does not compute right (the guard written into the model would fail
    requests that pass alone, for the others batched with them)."""
    batch = next((t.shape[0] for t in tensors if t.role == "input" and t.shape and isinstance(t.shape[0], str)
                  and t.shape[0]), None)
    guard = guard_of(model_proto)
    if isinstance(guard, str):
        return [guard]
    if max_batch_size == 0 or batch is None or guard is None:
        return []
    problems = _batch_condition_problems(guard, batch)
    bounds = [(lo, hi) for name, lo, hi in guard.ranges if name == batch]
    lowest = max((lo for lo, _ in bounds), default=0)
    highest = min((hi for _, hi in bounds if hi is not None), default=None)
    if lowest > 1:
        return problems + [
            f"max_batch_size {max_batch_size}: Triton sends batches of 1 to {max_batch_size}, but the graph "
            f"takes sizes from {lowest} on for its batch dim '{batch}' (it was traced for those; Triton does not "
            f"check; its trace branched on the batch size): use max_batch_size=0 and send batches of "
            f"{lowest} or more, or take the branch out of the model"]
    if highest is None or max_batch_size <= highest:
        return problems
    return problems + [
        f"max_batch_size {max_batch_size} is past the sizes the graph takes for its batch dim '{batch}' "
        f"(up to {highest}: it was traced for those; Triton does not check): use max_batch_size={highest}"]


def unenforced_problems(model_proto: Any) -> list[str]:
    """A model whose guard asks what Triton's config cannot (equal dims, ranges, size conditions)
    without the guard written into it (``enforced``): a request outside it is served wrong."""
    guard = guard_of(model_proto)
    if not isinstance(guard, Guard) or enforced(model_proto, guard) is model_proto:
        return []
    if any(node.name.startswith(PREFIX) for node in model_proto.graph.node):
        return []
    return [f"the graph's guard is not in the model ({words(guard)}): Triton does not check it, so a "
            "request outside it would be served the graph's answer for other sizes; write the model with "
            "to_triton or `clika-runtime triton`, which put the guard in the model"]


def guard_of(model_proto: Any) -> Guard | str | None:
    """The guard in the graph's metadata (``None``: none; a string: why the metadata is unreadable)."""
    try:
        found = metadata.read({p.key: p.value for p in model_proto.metadata_props}, "the graph")
    except GraphFileError as e:
        return str(e)
    return None if found is None else found.guard


def _batch_condition_problems(guard: Guard, batch: str) -> list[str]:
    reading = [render(tree, [r.name for r in guard.inputs]) for n, (tree, _) in enumerate(guard.conditions)
               if batch in guard.dims_read(n)]
    if not reading:
        return []
    return [f"max_batch_size > 0 but the graph was traced under a condition on its batch dim '{batch}' "
            f"({'; '.join(reading)}): requests batched together would change it; use max_batch_size=0"]


def _make_dynamic(tensor: Tensor) -> str:
    if tensor.role == "output":
        return "Triton splits every output along its dim 0 by request; use max_batch_size=0"
    return (f"make it dynamic when capturing, with dynamic_axes={{'{tensor.name}': {{0: 'batch'}}}}, a signature "
            f"TensorSpec(('batch', ...)), or a call at a second batch size before take_graph()")


def _shape(tensor: Tensor) -> str:
    return "[" + ", ".join(str(d) if d != "" else "?" for d in tensor.shape or ()) + "]"


def reference_problems(model_proto: Any) -> list[str]:
    """Weights the in-memory graph leaves in files: their location is refused when it could read
    outside the model's folder, and otherwise too, since there is nothing to copy."""
    problems = []
    for tensor, location in external_locations(model_proto):
        if escapes(location):
            problems.append(escape_problem(tensor, location))
        else:
            problems.append(f"tensor '{tensor}': weights left in the external file {location!r}, not in the graph: "
                            f"load the graph with ModelGraph.load(path), which reads them")
    return problems


def external_locations(model_proto: Any) -> list[tuple[str, str]]:
    return [
        (t.name, next((e.value for e in t.external_data if e.key == "location"), ""))
        for t in _all_tensors(model_proto) if t.data_location == _T.EXTERNAL
    ]


def _all_tensors(model_proto: Any) -> Iterator[Any]:
    """Every tensor that can hold weights: initializers (sparse ones too) and tensor attributes, in
    the graph, its subgraphs and the model's functions (graphfile.py reads the same from a file)."""
    yield from _graph_tensors(model_proto.graph)
    for function in model_proto.functions:
        yield from _attribute_tensors(function.attribute_proto)
        for node in function.node:
            yield from _attribute_tensors(node.attribute)


def _graph_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _attribute_tensors(node.attribute)


def _attribute_tensors(attributes: Any) -> Iterator[Any]:
    for attribute in attributes:
        if attribute.HasField("t"):
            yield attribute.t
        yield from attribute.tensors
        one_sparse = [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []
        for tensor in one_sparse + list(attribute.sparse_tensors):
            yield from (tensor.values, tensor.indices)
        for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
            yield from _graph_tensors(subgraph)


def escape_problem(tensor: str, location: str) -> str:
    return (f"tensor '{tensor}': external data location {location!r} is absolute or climbs out of the model's "
            f"folder ('..'): refused, it would read a file outside the repository")
