"""A graph written as a Triton model repository entry: ``<repository>/<name>/config.pbtxt`` and
``<repository>/<name>/<version>/model.onnx``, for Triton's onnxruntime backend (and KServe and
Seldon, which run ONNX on it). Nothing is written for a graph or options Triton would refuse: the
rules are ``rules``', and ``checker`` holds a written entry to the same ones.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol

import onnx

from clika_runtime.base.errors import DeployError
from clika_runtime.base.version import VERSION
from clika_runtime.format import writing
from clika_runtime.format.graphfile import too_big
from clika_runtime.triton import pbtxt
from clika_runtime.triton.rules import (
    CONFIG_FILE, MODEL_FILE, PLATFORM, TRITON_TYPES, Tensor, declared_tensors, default_name, name_problems,
    guard_of, range_problems, reference_problems, tensor_problems,
)
from clika_runtime.triton.enforced import enforced

logger = logging.getLogger("clika_runtime")

_DYNAMIC_BATCHING_KEYS = ("preferred_batch_size", "max_queue_delay_microseconds")


class Shippable(Protocol):
    """What the writer needs of a graph (``shipped.graph.ModelGraph``, which calls the writer)."""

    @property
    def model_proto(self) -> Any: ...

    @property
    def graph_name(self) -> str: ...


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
    name = default_name(graph.graph_name) if name is None else name
    tensors = declared_tensors(graph.model_proto)
    problems = (name_problems(name) + tensor_problems(tensors, max_batch_size) + reference_problems(graph.model_proto)
                + range_problems(graph.model_proto, tensors, max_batch_size))
    if problems:
        raise DeployError("; ".join(problems))
    if any(t.elem_type == onnx.TensorProto.BFLOAT16 for t in tensors):
        logger.warning("model '%s' has bfloat16 inputs or outputs: Triton's onnxruntime backend takes them "
                       "from release 26.03 on; older releases refuse the model", name)
    text = _config_text(graph.graph_name, name, tensors, max_batch_size, batching, instances, kind)
    folder = Path(repository) / name
    guard = guard_of(graph.model_proto)  # checked readable by range_problems
    proto = graph.model_proto if guard is None else enforced(graph.model_proto, guard)
    _write_model_file(proto, folder / str(version) / MODEL_FILE, external_data)
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
    if dynamic_batching is not True and not isinstance(dynamic_batching, Mapping):
        raise DeployError(f"dynamic_batching: expected True or a dict with some of {list(_DYNAMIC_BATCHING_KEYS)}, "
                          f"got {dynamic_batching!r}")
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


def _config_text(
    graph_name: str, name: str, tensors: list[Tensor], max_batch_size: int,
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


def _entry(tensor: Tensor, max_batch_size: int) -> str:
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


def _write_model_file(proto: Any, target: Path, external_data: bool | None) -> None:
    """Write the version's model: one file, or with external data the folder Triton's docs ask for
    (docs/model_repository.md, "ONNX Models": a folder named model.onnx holding model.onnx and the
    other files; the backend opens <folder>/model.onnx by path, so the data resolves beside it).
    ``save`` replaces files atomically; a change between the two layouts is made beside and
    swapped in by two renames: a moment without a model, never half of one."""
    if external_data is None:
        external_data = too_big(proto)
    if not target.exists() or target.is_dir() == external_data:
        writing.save(proto, target / MODEL_FILE if external_data else target, external_data=external_data)
        return
    token = secrets.token_hex(6)
    staged, aside = target.with_name(f".{target.name}.{token}"), target.with_name(f".{target.name}.{token}.old")
    try:
        writing.save(proto, staged / MODEL_FILE if external_data else staged, external_data=external_data)
        os.replace(target, aside)
        try:
            os.replace(staged, target)
        except OSError:
            os.replace(aside, target)  # the old model back, not none
            raise
    finally:
        for leftover in (staged, aside):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
