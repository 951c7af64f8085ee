"""The metadata a graph carries in ``metadata_props``: keys, schema version, and a defensive reader.

A graph file is untrusted data. Everything read here is size-capped before it is parsed, checked
for shape and depth, and refused with a ``GraphFileError`` that says what is wrong; nothing read
here names code to run (see treedesc.py for how output trees are rebuilt).

Schema 2 (this version): ``clika_runtime.schema`` = "2", ``clika_runtime.version`` (the library
version that wrote it), ``clika_runtime.inputs`` / ``clika_runtime.outputs`` (tree descriptions,
treedesc.py), ``clika_runtime.dims`` (per input, each axis an int or a dim name),
``clika_runtime.parameters`` (the target's positional parameter names), ``clika_runtime.guard``
(guards/json_form.py), ``clika_runtime.digest`` (the content digest, digest.py: written by
``ModelGraph.save``; files written before it, or by other tools, have none, and no reader of
schema 2 needs it), and for a reduced-precision graph ``clika_runtime.precision`` (its precision,
the agreement it was accepted by and what was measured: ``base.precision.Record``; absent for
fp32, so older readers of schema 2 still read such files). Schema 1 (files of clika_runtime 0.1, no schema key) had no guard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from clika_runtime.base.errors import GraphFileError
from clika_runtime.base.precision import Record
from clika_runtime.base.specs import TensorInfo
from clika_runtime.format import treedesc
from clika_runtime.guards import json_form as guards
from clika_runtime.guards.guard import Guard

SCHEMA = 2
META_SCHEMA = "clika_runtime.schema"
META_VERSION = "clika_runtime.version"
META_INPUTS = "clika_runtime.inputs"
META_OUTPUTS = "clika_runtime.outputs"
META_DIMS = "clika_runtime.dims"
META_PARAMETERS = "clika_runtime.parameters"
META_GUARD = "clika_runtime.guard"
META_PRECISION = "clika_runtime.precision"
META_DIGEST = "clika_runtime.digest"

MAX_VALUE_BYTES = 4 * 2**20  # far above any real description; a 50 MB value is an attack or a bug
_MAX_SCHEMA_DIGITS = 9
# Output dtypes a "scalar" leaf (a Python number the graph computes) can be read from.
_NUMBER_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                            "float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True)
class Metadata:
    """What a clika_runtime graph says about itself, validated."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    parameters: list[str]
    guard: Guard | None  # None: schema 1 (no shipped guard)
    precision: Record | None = None  # None: an fp32 graph


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
        inputs = treedesc.validated(_json(props, META_INPUTS))
        outputs = treedesc.validated(_json(props, META_OUTPUTS))
        parameters = _json(props, META_PARAMETERS, default=[])
        if not isinstance(parameters, list) or not all(isinstance(p, str) for p in parameters):
            raise ValueError("parameters: expected a list of names")
        pair = inputs.get("children", ())
        if inputs["kind"] != "tuple" or len(pair) != 2 or pair[0]["kind"] != "tuple" or pair[1]["kind"] != "dict":
            raise ValueError("inputs: expected the (args, kwargs) pair, a tuple and a dict")
        guard = guards.from_json(_json(props, META_GUARD)) if schema >= 2 else None
        precision = Record.from_json(_json(props, META_PRECISION)) if META_PRECISION in props else None
    except ValueError as e:
        raise GraphFileError(f"{where}: malformed clika_runtime metadata: {e}") from None
    return Metadata(inputs, outputs, parameters, guard, precision)


def check_fits(found: Metadata, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], where: str) -> None:
    """``GraphFileError`` unless the metadata describes this graph: one fed leaf per graph input, one
    output leaf per graph output (a Python number only from a rank-0 numeric output), and a guard
    with the graph's input names, dtypes, ranks and static sizes. A file that lies here would
    otherwise fail on every call, in onnxruntime or while rebuilding the outputs."""
    fed = sum(leaf["kind"] == "leaf" for leaf in treedesc.leaves(found.inputs))
    returned = [leaf for leaf in treedesc.leaves(found.outputs) if leaf["kind"] in ("leaf", "scalar")]
    problems = []
    if fed != len(inputs):
        problems.append(f"the input tree feeds {fed} tensors, the graph has {len(inputs)} inputs")
    if len(returned) != len(outputs):
        problems.append(f"the output tree takes {len(returned)} values, the graph has {len(outputs)} outputs")
    for leaf, info in zip(returned, outputs):
        if leaf["kind"] == "scalar" and (info.shape != () or info.dtype not in _NUMBER_DTYPES):
            problems.append(f"output '{info.name}' is {info}, not a number the output tree can return")
    if found.guard is not None:
        problems += _guard_problems(found.guard, inputs)
    if problems:
        raise GraphFileError(f"{where}: clika_runtime metadata does not describe this graph: {'; '.join(problems[:3])}")


def _guard_problems(guard: Guard, inputs: Sequence[TensorInfo]) -> list[str]:
    names = [i.name for i in inputs]
    if guard.names != names:
        return [f"the guard is for inputs {guard.names[:10]}, the graph's are {names[:10]}"]
    problems = []
    for rule, info in zip(guard.inputs, inputs):
        shape = () if rule.shape is None else rule.shape
        static = all(type(want) is not int or not isinstance(have, int) or want == have
                     for want, have in zip(shape, info.shape))
        if rule.dtype != info.dtype or len(shape) != len(info.shape) or not static:
            problems.append(f"the guard takes input '{rule.name}' as {rule.dtype}{list(shape)}, the graph as {info}")
        elif any(isinstance(have, int) and type(want) is not int for want, have in zip(shape, info.shape)):
            problems.append(f"the guard lets input '{rule.name}' vary where the graph is static: {info}")
    return problems


def _schema(props: Mapping[str, str], where: str) -> int:
    text = props.get(META_SCHEMA)
    if text is None:
        return 1
    # isdigit alone takes '²' and other Unicode digits, which int() refuses
    if not (text.isascii() and text.isdigit()) or len(text) > _MAX_SCHEMA_DIGITS:
        raise GraphFileError(f"{where}: malformed clika_runtime metadata schema {text[:20]!r}: expected a number")
    schema = int(text)
    if schema > SCHEMA:
        raise GraphFileError(
            f"{where}: clika_runtime metadata schema {schema} is newer than this clika_runtime reads ({SCHEMA}); "
            f"upgrade clika_runtime"
        )
    return schema


def _json(props: Mapping[str, str], key: str, default: Any = None) -> Any:
    text = props.get(key)
    if text is None:
        if default is not None:
            return default
        raise ValueError(f"{key} is missing")
    if len(text) > MAX_VALUE_BYTES:
        raise ValueError(f"{key} is {len(text):,} characters, past the {MAX_VALUE_BYTES:,} allowed")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{key} is nested too deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{key} is not JSON ({e.msg} at {e.pos})") from None
    except ValueError as e:  # json's own limits, e.g. an integer of more than 4300 digits
        raise ValueError(f"{key} is not JSON this reader takes ({str(e)[:80]})") from None
