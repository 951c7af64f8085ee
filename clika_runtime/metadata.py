"""The metadata a graph carries in ``metadata_props``: keys, schema version, and a defensive reader.

A graph file is untrusted data. Everything read here is size-capped before it is parsed, checked
for shape and depth, and refused with a ``GraphFileError`` that says what is wrong; nothing read
here names code to run (see treedesc.py for how output trees are rebuilt).

Schema 2 (this version): ``clika_runtime.schema`` = "2", ``clika_runtime.version`` (the library
version that wrote it), ``clika_runtime.inputs`` / ``clika_runtime.outputs`` (tree descriptions,
treedesc.py), ``clika_runtime.dims`` (per input, each axis an int or a dim name),
``clika_runtime.parameters`` (the target's positional parameter names), ``clika_runtime.guard``
(guards.py's JSON form). Schema 1 (files of clika_runtime 0.1, no schema key) had no guard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from clika_runtime import guards, treedesc
from clika_runtime.errors import GraphFileError
from clika_runtime.guards import Guard

SCHEMA = 2
META_SCHEMA = "clika_runtime.schema"
META_VERSION = "clika_runtime.version"
META_INPUTS = "clika_runtime.inputs"
META_OUTPUTS = "clika_runtime.outputs"
META_DIMS = "clika_runtime.dims"
META_PARAMETERS = "clika_runtime.parameters"
META_GUARD = "clika_runtime.guard"

MAX_VALUE_BYTES = 4 * 2**20  # far above any real description; a 50 MB value is an attack or a bug


@dataclass(frozen=True)
class Metadata:
    """What a clika_runtime graph says about itself, validated."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    parameters: list[str]
    guard: Guard | None  # None: schema 1 (no shipped guard)


def entries(values: Mapping[str, Any]) -> dict[str, str]:
    """``metadata_props`` entries: JSON-encoded unless already strings."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in values.items()}


def attach(model_proto: Any, values: Mapping[str, Any]) -> None:
    """Set ``metadata_props`` entries of a ``ModelProto`` (JSON-encoded unless already strings)."""
    existing = {p.key: p for p in model_proto.metadata_props}
    for key, text in entries(values).items():
        if key in existing:
            existing[key].value = text
        else:
            prop = model_proto.metadata_props.add()
            prop.key, prop.value = key, text


def read(props: Mapping[str, str], where: str) -> Metadata | None:
    """The validated metadata of a graph, ``None`` for a graph from another tool (no tree
    descriptions), ``GraphFileError`` for anything malformed, oversized or from a newer schema."""
    if META_INPUTS not in props and META_OUTPUTS not in props:
        return None
    schema = _schema(props, where)
    try:
        inputs = treedesc.validated(_json(props, META_INPUTS, where))
        outputs = treedesc.validated(_json(props, META_OUTPUTS, where))
        parameters = _json(props, META_PARAMETERS, where, default=[])
        if not isinstance(parameters, list) or not all(isinstance(p, str) for p in parameters):
            raise ValueError("parameters: expected a list of names")
        if inputs.get("kind") != "tuple" or len(inputs.get("children", ())) != 2:
            raise ValueError("inputs: expected the (args, kwargs) pair")
        guard = guards.from_json(_json(props, META_GUARD, where)) if schema >= 2 else None
    except ValueError as e:
        raise GraphFileError(f"{where}: malformed clika_runtime metadata: {e}") from None
    return Metadata(inputs, outputs, parameters, guard)


def _schema(props: Mapping[str, str], where: str) -> int:
    text = props.get(META_SCHEMA)
    if text is None:
        return 1
    if not text.isdigit():
        raise GraphFileError(f"{where}: malformed clika_runtime metadata schema {text[:20]!r}")
    schema = int(text)
    if schema > SCHEMA:
        raise GraphFileError(
            f"{where}: clika_runtime metadata schema {schema} is newer than this clika_runtime reads ({SCHEMA}); "
            f"upgrade clika_runtime"
        )
    return schema


def _json(props: Mapping[str, str], key: str, where: str, default: Any = None) -> Any:
    text = props.get(key)
    if text is None:
        if default is not None:
            return default
        raise ValueError(f"{key} is missing")
    if len(text) > MAX_VALUE_BYTES:
        raise GraphFileError(f"{where}: metadata {key} is {len(text):,} bytes, past the {MAX_VALUE_BYTES:,} allowed")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{key} is nested too deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{key} is not JSON ({e.msg} at {e.pos})") from None
