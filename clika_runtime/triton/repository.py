"""A graph as a Triton model repository entry, and the check of such an entry against its graph.

Triton (and KServe and Seldon, which run ONNX on it) loads ``<repository>/<name>/config.pbtxt`` and
``<repository>/<name>/<version>/model.onnx`` with its onnxruntime backend. Every refusal here is a
rule Triton enforces when it loads the model, or one without which its batcher would return wrong
answers; the comment at each rule says where it comes from, in Triton's sources as of release 26.06:
"core" is github.com/triton-inference-server/core, "ort" is .../onnxruntime_backend, "docs" is
.../server/docs/user_guide.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Protocol

import onnx

from clika_runtime.base.errors import DeployError, GraphFileError
from clika_runtime.base.version import VERSION
from clika_runtime.format import metadata
from clika_runtime.format.graphfile import escapes, outside, too_big
from clika_runtime.triton import pbtxt


class Shippable(Protocol):
    """What the writer needs of a graph (``shipped.graph.ModelGraph``, which calls the writer)."""

    @property
    def model_proto(self) -> Any: ...

    @property
    def graph_name(self) -> str: ...

    def save(self, path: str | os.PathLike, *, external_data: bool | None = None) -> Any: ...

logger = logging.getLogger("clika_runtime")

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
_DYNAMIC_BATCHING_KEYS = ("preferred_batch_size", "max_queue_delay_microseconds")


@dataclass(frozen=True)
class _Tensor:
    """A graph input or output: ``shape`` None when the graph gives none; ints static, strs dynamic
    (the dim's name, ``""`` when unnamed)."""

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


@dataclass(frozen=True)
class TensorConfig:
    """One ``input`` or ``output`` entry of a config.pbtxt."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None


@dataclass(frozen=True)
class TritonConfig:
    """The parts of a config.pbtxt that decide whether Triton's onnxruntime backend takes the model."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    preferred_batch_sizes: tuple[int, ...] | None  # None: no dynamic_batching
    model_filename: str


# ------------------------------------------------------------------------------------------- writing


def write_model(
    graph: Shippable,
    repository: str | os.PathLike,
    name: str | None = None,
    *,
    version: int = 1,
    max_batch_size: int = 0,
    dynamic_batching: bool | Mapping[str, Any] | None = None,
    instances: int = 1,
    kind: Literal["cpu", "gpu"] = "cpu",
    external_data: bool | None = None,
) -> Path:
    """Write ``graph`` into a Triton model repository; see ``ModelGraph.to_triton``."""
    batching = _checked_options(version, max_batch_size, dynamic_batching, instances, kind)
    name = _default_name(graph.graph_name) if name is None else name
    tensors = _tensors(graph.model_proto)
    problems = (_name_problems(name) + _tensor_problems(tensors, max_batch_size) + _reference_problems(graph.model_proto)
                + _range_problems(graph.model_proto, tensors, max_batch_size))
    if problems:
        raise DeployError("; ".join(problems))
    if any(t.elem_type == _T.BFLOAT16 for t in tensors):
        logger.warning("model '%s' has bfloat16 inputs or outputs: Triton's onnxruntime backend takes them "
                       "from release 26.03 on; older releases refuse the model", name)
    text = _config_text(graph.graph_name, name, tensors, max_batch_size, batching, instances, kind)
    folder = Path(repository) / name
    _write_model_file(graph, folder / str(version) / MODEL_FILE, external_data)
    # The config goes last and whole, so that a Triton polling the repository never sees a config
    # without its model, nor half a config.
    partial = folder / f".{CONFIG_FILE}.partial"
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, folder / CONFIG_FILE)
    return folder


def _checked_options(
    version: int, max_batch_size: int, dynamic_batching: bool | Mapping[str, Any] | None, instances: int, kind: str,
) -> dict[str, Any] | None:
    """Check the plain options; return the dynamic batching settings (None: off)."""
    _require_int("version", version, 1)  # docs/model_repository.md: versions are positive integers
    _require_int("max_batch_size", max_batch_size, 0)  # core ValidateModelConfig: non-negative
    _require_int("instances", instances, 1)
    if kind not in ("cpu", "gpu"):
        raise DeployError(f"kind: expected 'cpu' or 'gpu', got {kind!r}")
    if dynamic_batching is None or dynamic_batching is False:
        return None
    if max_batch_size == 0:
        raise DeployError("dynamic_batching needs max_batch_size > 0: Triton's batcher forms batches of at most "
                          "that size")
    settings = {} if dynamic_batching is True else dict(dynamic_batching)
    unknown = sorted(set(settings) - set(_DYNAMIC_BATCHING_KEYS))
    if unknown:
        raise DeployError(f"dynamic_batching: unknown key(s) {unknown}; expected some of "
                          f"{list(_DYNAMIC_BATCHING_KEYS)}")
    sizes = settings.get("preferred_batch_size", [])
    if not isinstance(sizes, (list, tuple)):
        raise DeployError(f"dynamic_batching preferred_batch_size: expected a list of ints, got {sizes!r}")
    for size in sizes:
        # core ValidateModelConfig: "dynamic batching preferred size must be <= max batch size"
        _require_int("dynamic_batching preferred_batch_size", size, 1)
        if size > max_batch_size:
            raise DeployError(f"dynamic_batching preferred_batch_size {size} is past max_batch_size {max_batch_size}")
    _require_int("dynamic_batching max_queue_delay_microseconds", settings.get("max_queue_delay_microseconds", 0), 0)
    return settings


def _require_int(what: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DeployError(f"{what}: expected an int >= {minimum}, got {value!r}")


def _default_name(graph_name: str) -> str:
    """The graph name (a function's own name, not its ``outer.<locals>.`` prefix) kept to characters
    that every file system and a URL path segment (KServe v2's ``/v2/models/<name>``) take as they are."""
    own = graph_name.rpartition(".<locals>.")[2]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", own).strip("._-") or "model"


def _config_text(
    graph_name: str, name: str, tensors: list[_Tensor], max_batch_size: int,
    batching: Mapping[str, Any] | None, instances: int, kind: str,
) -> str:
    lines = [
        f"# Written by clika_runtime {VERSION} from graph {graph_name!r}; check: clika-runtime validate <this folder>",
        f"name: {pbtxt.quote(name)}",
        f'platform: "{PLATFORM}"',
        f"max_batch_size: {max_batch_size}",
    ]
    for role in ("input", "output"):
        blocks = [_entry(t, max_batch_size) for t in tensors if t.role == role]
        lines += [f"{role} [", ",\n".join(blocks), "]"]
    if batching is not None:
        lines.append("dynamic_batching {")
        if "preferred_batch_size" in batching:
            lines.append(f"  preferred_batch_size: {_list(batching['preferred_batch_size'])}")
        if "max_queue_delay_microseconds" in batching:
            lines.append(f"  max_queue_delay_microseconds: {batching['max_queue_delay_microseconds']}")
        lines.append("}")
    lines += ["instance_group [", "  {", f"    count: {instances}", f"    kind: KIND_{kind.upper()}", "  }", "]"]
    return "\n".join(lines) + "\n"


def _entry(tensor: _Tensor, max_batch_size: int) -> str:
    dims = tensor.dims[1:] if max_batch_size > 0 else tensor.dims
    lines = ["  {", f"    name: {pbtxt.quote(tensor.name)}", f"    data_type: {TRITON_TYPES[tensor.elem_type]}"]
    # core ValidateIOShape: every entry needs non-empty dims. A scalar the model sees (a [batch]
    # tensor when batching, a rank-0 one when not) is dims [1]: reshaped to [] when batching
    # (docs/model_configuration.md, "Reshape"); left so when not, because Triton refuses an empty
    # reshape without batching and the onnxruntime backend takes all-1 dims for a rank-0 tensor
    # (ort ValidateInputs / ValidateOutputs, "scalar tensor").
    lines.append(f"    dims: {_list(dims or (1,))}")
    if not dims and max_batch_size > 0:
        lines.append("    reshape: { shape: [ ] }")
    return "\n".join(lines + ["  }"])


def _list(values: Any) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"


def _write_model_file(graph: Shippable, target: Path, external_data: bool | None) -> None:
    if target.is_dir():  # an earlier write of this version, in the multi-file layout
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if external_data is None:
        external_data = too_big(graph.model_proto)
    if external_data:
        # docs/model_repository.md, "ONNX Models": a model of several files is a folder named
        # model.onnx holding model.onnx and the other files; the backend opens <folder>/model.onnx
        # by path, so external data resolves beside it.
        graph.save(target / MODEL_FILE, external_data=True)
    else:
        graph.save(target, external_data=False)


# --------------------------------------------------------------------------- rules shared by both ends


def _tensors(model_proto: Any) -> list[_Tensor]:
    """Graph inputs (initializers left out, as onnxruntime does) then outputs."""
    initializers = {i.name for i in model_proto.graph.initializer}
    inputs = [v for v in model_proto.graph.input if v.name not in initializers]
    return [_tensor("input", v) for v in inputs] + [_tensor("output", v) for v in model_proto.graph.output]


def _tensor(role: str, value: Any) -> _Tensor:
    tensor_type = value.type.tensor_type
    shape = None
    if tensor_type.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim)
    return _Tensor(role, value.name, tensor_type.elem_type, shape)


def _name_problems(name: str) -> list[str]:
    # core model_repository_manager.cc, ValidateModelName: "Model name cannot be empty" once
    # whitespace is trimmed, and "must not contain path traversal characters" ('..' or '/').
    # The same file requires the directory name to equal the config's name ("directory name must
    # equal model name"), so the name is one directory name: '.' and NUL cannot be.
    if not name.strip():
        return [f"model name {name!r}: Triton refuses an empty or all-space name"]
    if name in (".", "..") or "/" in name or "\0" in name:
        return [f"model name {name!r}: Triton needs one directory name (no '/', not '.' or '..'), "
                f"e.g. {_default_name(name)!r}"]
    return []


def _tensor_problems(tensors: list[_Tensor], max_batch_size: int) -> list[str]:
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


def _batch_problems(tensors: list[_Tensor]) -> list[str]:
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


def _batch_beyond_dim0(tensors: list[_Tensor], batch: str) -> list[str]:
    """A tensor that also uses the batch dim past dim 0 (``x @ x.T``: ``[batch, batch]``) mixes the
    rows of requests Triton stacked together: each would be answered with the others' rows."""
    return [f"max_batch_size > 0 but {t.where} {_shape(t)} uses the batch dim '{batch}' past dim 0: requests "
            "batched together would see each other's rows; use max_batch_size=0"
            for t in tensors if t.shape and batch in t.shape[1:]]


def _range_problems(model_proto: Any, tensors: list[_Tensor], max_batch_size: int) -> list[str]:
    """Batch sizes Triton sends (1 to ``max_batch_size``) that the graph's guard does not take
    for its batch dim (a branch on the batch size traced one way: ``x.shape[0] > 4``). Triton does
    not read the guard, so its batcher would run the graph on batches it does not compute right."""
    batch = next((t.shape[0] for t in tensors if t.role == "input" and t.shape and isinstance(t.shape[0], str)
                  and t.shape[0]), None)
    try:
        found = metadata.read({p.key: p.value for p in model_proto.metadata_props}, "the graph")
    except GraphFileError as e:
        return [str(e)]
    if max_batch_size == 0 or batch is None or found is None or found.guard is None:
        return []
    bounds = [(lo, hi) for name, lo, hi in found.guard.ranges if name == batch]
    lowest = max((lo for lo, _ in bounds), default=0)
    highest = min((hi for _, hi in bounds if hi is not None), default=None)
    if lowest > 1:
        return [f"max_batch_size {max_batch_size}: Triton sends batches of 1 to {max_batch_size}, but the graph "
                f"takes sizes from {lowest} on for its batch dim '{batch}' (it was traced for those; Triton does not "
                f"check; its trace branched on the batch size): use max_batch_size=0 and send batches of "
                f"{lowest} or more, or take the branch out of the model"]
    if highest is None or max_batch_size <= highest:
        return []
    return [f"max_batch_size {max_batch_size} is past the sizes the graph takes for its batch dim '{batch}' "
            f"(up to {highest}: it was traced for those; Triton does not check): use max_batch_size={highest}"]


def _make_dynamic(tensor: _Tensor) -> str:
    if tensor.role == "output":
        return "Triton splits every output along its dim 0 by request; use max_batch_size=0"
    return (f"make it dynamic when capturing, with dynamic_axes={{'{tensor.name}': {{0: 'batch'}}}}, a signature "
            f"TensorSpec(('batch', ...)), or a call at a second batch size before take_graph()")


def _shape(tensor: _Tensor) -> str:
    return "[" + ", ".join(str(d) if d != "" else "?" for d in tensor.shape or ()) + "]"


def _reference_problems(model_proto: Any) -> list[str]:
    """Weights the in-memory graph leaves in files: their location is refused when it could read
    outside the model's folder, and otherwise too, since there is nothing to copy."""
    problems = []
    for tensor, location in _external_locations(model_proto):
        if escapes(location):
            problems.append(_escape_problem(tensor, location))
        else:
            problems.append(f"tensor '{tensor}': weights left in the external file {location!r}, not in the graph: "
                            f"load the graph with ModelGraph.load(path), which reads them")
    return problems


def _external_locations(model_proto: Any) -> list[tuple[str, str]]:
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


def _escape_problem(tensor: str, location: str) -> str:
    return (f"tensor '{tensor}': external data location {location!r} is absolute or climbs out of the model's "
            f"folder ('..'): refused, it would read a file outside the repository")


# ------------------------------------------------------------------------------------------ checking


def check_repository(model_folder: str | os.PathLike) -> list[str]:
    """What Triton's onnxruntime backend would refuse in a model folder (``<repository>/<name>``),
    from its files alone: config.pbtxt against Triton's schema and rules, and against the graph of
    the highest version (the one Triton's default version policy loads). Empty when fine.

    The config is parsed with Triton's own schema (tritonclient's ``model_config_pb2``) when
    tritonclient is installed, else with ``clika_runtime.pbtxt``'s reader.
    """
    folder = Path(model_folder)
    try:
        config = read_config(folder / CONFIG_FILE)
    except (OSError, ValueError) as e:
        return [f"{folder / CONFIG_FILE}: {e}"]
    problems = _config_problems(config, folder.name)
    version, model = latest_model(folder, config.model_filename)
    if model is None:
        if version is None:
            return problems + [f"{folder}: no version folder (a positive integer name)"]
        return problems + [f"{folder}: version {version} has no {config.model_filename}"]
    try:
        proto = onnx.load_model(str(model), load_external_data=False)
    except Exception as e:  # onnx raises protobuf's and its own types alike for a bad file
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return problems + [f"{model}: not a readable ONNX model: {detail}"]
    tensors = _tensors(proto)
    return (problems + _stored_data_problems(proto, model.parent)
            + _tensor_problems(_listed(tensors, config), config.max_batch_size) + _agreement_problems(config, tensors)
            + _range_problems(proto, tensors, config.max_batch_size))


def read_config(path: str | os.PathLike) -> TritonConfig:
    """Parse a config.pbtxt (Triton's schema when tritonclient is installed); ``ValueError`` if it does not parse."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return _summary(pbtxt.parse(text))
    try:
        message = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ValueError(f"not a Triton model config: {e}") from e
    return _summary(_message_tree(message))


def _message_tree(message: Any) -> pbtxt.Tree:
    """A parsed protobuf message in the reader's form, ``{field: [values]}`` with enums by name."""
    tree: pbtxt.Tree = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # maps (parameters, metric tags): nothing checked here reads them
        values = list(value) if field.is_repeated else [value]
        if field.message_type is not None:
            values = [_message_tree(v) for v in values]
        elif field.enum_type is not None:
            values = [field.enum_type.values_by_number[v].name for v in values]
        tree[field.name] = values
    return tree


def _summary(tree: pbtxt.Tree) -> TritonConfig:
    batching = _first(tree, "dynamic_batching", None)
    preferred = None if batching is None else tuple(int(s) for s in batching.get("preferred_batch_size", []))
    return TritonConfig(
        name=str(_first(tree, "name", "")),
        platform=str(_first(tree, "platform", "")),
        backend=str(_first(tree, "backend", "")),
        max_batch_size=int(_first(tree, "max_batch_size", 0)),
        inputs=tuple(_tensor_config(e) for e in tree.get("input", [])),
        outputs=tuple(_tensor_config(e) for e in tree.get("output", [])),
        preferred_batch_sizes=preferred,
        model_filename=str(_first(tree, "default_model_filename", "")) or MODEL_FILE,
    )


def _tensor_config(entry: pbtxt.Tree) -> TensorConfig:
    reshape = _first(entry, "reshape", None)
    return TensorConfig(
        name=str(_first(entry, "name", "")),
        data_type=str(_first(entry, "data_type", "TYPE_INVALID")),
        dims=tuple(int(d) for d in entry.get("dims", [])),
        reshape=None if reshape is None else tuple(int(d) for d in reshape.get("shape", [])),
    )


def _first(tree: pbtxt.Tree, key: str, default: Any) -> Any:
    return tree.get(key, [default])[0]


def latest_model(model_folder: str | os.PathLike, filename: str = MODEL_FILE) -> tuple[int | None, Path | None]:
    """The highest version in a model folder and its ONNX file (None where there is none).

    docs/model_repository.md: version folders are numerically named, and names starting with '0'
    are ignored; a model of several files is a folder ``<version>/model.onnx/`` holding ``model.onnx``.
    """
    folder = Path(model_folder)
    versions = [int(p.name) for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"[1-9][0-9]*", p.name)]
    if not versions:
        return None, None
    version = max(versions)
    if escapes(filename):  # a hostile config's default_model_filename: never a path out of the folder
        return version, None
    path = folder / str(version) / filename
    if path.is_dir():
        path = path / MODEL_FILE
    return version, path if path.is_file() else None


def _config_problems(config: TritonConfig, folder_name: str) -> list[str]:
    problems = _name_problems(config.name or folder_name)
    if escapes(config.model_filename):
        problems.append(f"default_model_filename {config.model_filename[:100]!r} is absolute or climbs out of the "
                        f"version folder ('..'): refused, it would read a file outside the repository")
    # core model_repository_manager.cc: "directory name must equal model name".
    if config.name and config.name != folder_name:
        problems.append(f"config name '{config.name}' differs from its folder's name '{folder_name}': "
                        f"Triton requires them equal")
    if config.platform != PLATFORM and config.backend != "onnxruntime":
        problems.append(f"config platform {config.platform!r}, backend {config.backend!r}: expected platform "
                        f"'{PLATFORM}' for an ONNX model")
    if config.max_batch_size < 0:  # core ValidateModelConfig
        problems.append(f"max_batch_size {config.max_batch_size}: Triton requires it >= 0")
    for size in config.preferred_batch_sizes or ():  # core ValidateModelConfig
        if not 0 < size <= config.max_batch_size:
            problems.append(f"dynamic_batching preferred_batch_size {size}: Triton requires "
                            f"1..max_batch_size ({config.max_batch_size})")
    return problems


def _stored_data_problems(model_proto: Any, folder: Path) -> list[str]:
    """Weights the stored model reads from anything but a regular file in its folder."""
    problems = []
    for tensor, location in _external_locations(model_proto):
        if escapes(location):
            problems.append(_escape_problem(tensor, location))
        elif (why := outside(folder, location)) is not None:  # missing, linked out, not a file, unresolvable
            problems.append(f"tensor '{tensor}': external data location {location[:100]!r} {why}")
    return problems


def _listed(tensors: list[_Tensor], config: TritonConfig) -> list[_Tensor]:
    """Every graph input (Triton feeds them all) and the outputs the config lists."""
    outputs = {o.name for o in config.outputs}
    return [t for t in tensors if t.role == "input" or t.name in outputs]


def _agreement_problems(config: TritonConfig, tensors: list[_Tensor]) -> list[str]:
    problems = []
    inputs = [t for t in tensors if t.role == "input"]
    if len(config.inputs) != len(inputs):  # ort ValidateInputs: "configuration expects N inputs, model provides M"
        problems.append(f"config lists {len(config.inputs)} input(s), the graph has {len(inputs)}: "
                        f"{[t.name for t in inputs]}")
    for role, entries in (("input", config.inputs), ("output", config.outputs)):
        graph = {t.name: t for t in tensors if t.role == role}
        for entry in entries:
            tensor = graph.get(entry.name)
            if tensor is None:  # ort CheckAllowedModelInput / CheckAllowedModelOutput
                problems.append(f"config {role} '{entry.name}' is not a graph {role}; the graph's are {sorted(graph)}")
            else:
                problems += _entry_problems(entry, tensor, config.max_batch_size)
    return problems


def _entry_problems(entry: TensorConfig, tensor: _Tensor, max_batch_size: int) -> list[str]:
    """One config entry against its graph tensor, as Triton's core and onnxruntime backend compare them."""
    where, problems = tensor.where, []
    expected = TRITON_TYPES.get(tensor.elem_type)
    if expected is not None and entry.data_type != expected:  # ort ValidateInputs / ValidateOutputs
        problems.append(f"{where}: config data_type {entry.data_type}, the graph's is {expected}")
    # core ValidateIOShape: non-empty dims of ints >= 1 or -1; no empty reshape without batching.
    if not entry.dims or any(d < 1 and d != -1 for d in entry.dims):
        problems.append(f"{where}: config dims {list(entry.dims)}: Triton requires one or more dims, each >= 1 or -1")
    if entry.reshape == () and max_batch_size == 0:
        problems.append(f"{where}: an empty reshape needs max_batch_size > 0 (Triton refuses scalars otherwise)")
    if entry.reshape == () and entry.dims != (1,):
        problems.append(f"{where}: an empty reshape needs dims [1], got {list(entry.dims)}")
    seen = entry.reshape if entry.reshape is not None else entry.dims
    if tensor.shape is None:
        return problems
    if not tensor.shape:  # ort: a rank-0 model tensor takes config dims that are all 1
        if any(d != 1 for d in seen):
            problems.append(f"{where} is rank 0 in the graph: config dims must all be 1, got {list(seen)}")
        return problems
    # ort CompareDimsSupported: the config's shape (batch dim first when batching) against the
    # model's; a static model dim must match, and an output's dynamic dims must be -1 as well.
    model = tensor.dims[1:] if max_batch_size > 0 else tensor.dims
    exact = tensor.role == "output"
    fits = len(model) == len(seen) and all(m == s for m, s in zip(model, seen) if exact or m != -1)
    if not fits:
        batch = "[-1] + " if max_batch_size > 0 else ""
        problems.append(f"{where}: config shape {batch}{list(seen)} does not fit the graph's {list(tensor.dims)}")
    return problems
