"""The check of a Triton model repository entry against its graph: what Triton's onnxruntime
backend would refuse in a model folder, read from its files alone (``clika-runtime validate`` on a
model folder). The config is read with Triton's own schema when tritonclient is installed, else
with ``pbtxt``'s reader; the rules are ``rules``', the writer's. The comments say where each rule
comes from, in Triton's sources as of release 26.06 ("core", "ort" and "docs" as in ``rules``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from clika_runtime.format.graphfile import escapes, outside
from clika_runtime.triton import pbtxt
from clika_runtime.triton.rules import (
    CONFIG_FILE, MODEL_FILE, PLATFORM, TRITON_TYPES, Tensor, declared_tensors, escape_problem, external_locations,
    name_problems, range_problems, tensor_problems, unenforced_problems,
)


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


def check_repository(model_folder: str | os.PathLike) -> list[str]:
    """What Triton's onnxruntime backend would refuse in a model folder (``<repository>/<name>``),
    from its files alone: config.pbtxt against Triton's schema and rules, and against the graph of
    the highest version (the one Triton's default version policy loads). Empty when fine.

    The config is parsed with Triton's own schema (tritonclient's ``model_config_pb2``) when
    tritonclient is installed, else with ``pbtxt``'s reader.
    """
    folder = Path(model_folder)
    if not (folder / CONFIG_FILE).is_file():
        return [_not_a_model_folder(folder)]
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
    tensors = declared_tensors(proto)
    return (problems + _stored_data_problems(proto, model.parent)
            + tensor_problems(_listed(tensors, config), config.max_batch_size) + _agreement_problems(config, tensors)
            + range_problems(proto, tensors, config.max_batch_size) + unenforced_problems(proto))


def _not_a_model_folder(folder: Path) -> str:
    """Why ``folder`` is no model folder, with what to pass instead (a repository's model folders)."""
    if not folder.is_dir():
        return f"{folder}: no such folder (expected a Triton model folder, holding {CONFIG_FILE})"
    models = sorted(p.name for p in folder.iterdir() if (p / CONFIG_FILE).is_file())
    if models:
        shown = ", ".join(models[:5]) + (f" and {len(models) - 5} more" if len(models) > 5 else "")
        return f"{folder}: a model repository, not a model folder: check one of its models ({shown})"
    return f"{folder}: no {CONFIG_FILE} here (expected a Triton model folder)"


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
    problems = name_problems(config.name or folder_name)
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
    for tensor, location in external_locations(model_proto):
        if escapes(location):
            problems.append(escape_problem(tensor, location))
        elif (why := outside(folder, location)) is not None:  # missing, linked out, not a file, unresolvable
            problems.append(f"tensor '{tensor}': external data location {location[:100]!r} {why}")
    return problems


def _listed(tensors: list[Tensor], config: TritonConfig) -> list[Tensor]:
    """Every graph input (Triton feeds them all) and the outputs the config lists."""
    outputs = {o.name for o in config.outputs}
    return [t for t in tensors if t.role == "input" or t.name in outputs]


def _agreement_problems(config: TritonConfig, tensors: list[Tensor]) -> list[str]:
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


def _entry_problems(entry: TensorConfig, tensor: Tensor, max_batch_size: int) -> list[str]:
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
