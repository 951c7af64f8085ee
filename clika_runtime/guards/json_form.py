"""A guard's shipped form: the versioned JSON that ships in a graph's metadata, and its reader.

``to_json`` writes what a guard says but the in-process part (no device: any place; no size 0/1
to verify). ``from_json`` reads a file's guard as untrusted data: everything is checked once,
here, so that no call can fail on it later (``ValueError`` naming what is malformed).

No torch: a loaded graph is guarded on a box with only onnxruntime and numpy.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from clika_runtime.guards.conditions import ARITY, OPS
from clika_runtime.guards.guard import NUMBER_PREFIX, Guard, InputRule, Verified

GUARD_VERSION = 1
# Bounds on a shipped guard, far above what a trace produces: with int64 constants, evaluating
# every condition of a call stays cheap whatever the file says.
MAX_CONDITION_DEPTH = 32
MAX_CONDITION_NODES = 10_000
_INT64 = (-(2**63), 2**63 - 1)
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def to_json(guard: Guard) -> dict[str, Any]:
    """The versioned JSON form that ships in a graph's metadata (no device: any place)."""
    return {
        "version": GUARD_VERSION,
        "inputs": [_rule_json(r) for r in guard.inputs],
        "ranges": {name: [lo, hi] for name, lo, hi in guard.ranges},
        "conditions": [{"when": _tree_json(t), "is": v} for t, v in guard.conditions],
        "verified": [{"sizes": dict(v.sizes), "outcomes": list(v.outcomes)} for v in guard.verified],
        "example": dict(guard.example),
    }


def from_json(data: Mapping[str, Any]) -> Guard:
    """Parse the shipped form; ``ValueError`` naming what is malformed.

    Everything is checked here, so that no call can fail on it later: ints are int64 (sizes
    and numbers in the graph are), conditions use known ops with their arity, read sizes of
    shaped inputs on axes they have and numbers of number inputs, and are bounded in size.
    """
    if not isinstance(data, Mapping) or data.get("version") != GUARD_VERSION:
        version = data.get("version") if isinstance(data, Mapping) else None
        raise ValueError(f"guard: unknown version {_brief(version)} "
                         f"(this clika_runtime reads version {GUARD_VERSION})")
    try:
        inputs = tuple(_rule_from(r) for r in data["inputs"])
        ranges = tuple((_dim(n), _int(lo), _optional_int(hi)) for n, (lo, hi) in data.get("ranges", {}).items())
        budget = [MAX_CONDITION_NODES]
        conditions = tuple((_tree_from(c["when"], inputs, budget), _scalar(c["is"]))
                           for c in data.get("conditions", []))
        verified = tuple(
            Verified(tuple(sorted((_name(k), _int(v)) for k, v in p["sizes"].items())),
                     tuple(map(_outcome, p["outcomes"])))
            for p in data.get("verified", [])
        )
        example = tuple((_name(k), _int(v)) for k, v in data.get("example", {}).items())
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"guard: malformed ({type(e).__name__}: {str(e)[:200]})") from None
    return Guard(inputs, ranges, conditions, verified, example)


def _rule_json(rule: InputRule) -> dict[str, Any]:
    if rule.shape is None:
        return {"name": rule.name, "dtype": rule.dtype, "number": list(rule.number or (None, None))}
    return {"name": rule.name, "dtype": rule.dtype, "shape": list(rule.shape)}


def _rule_from(data: Mapping[str, Any]) -> InputRule:
    name, dtype = _name(data["name"]), data["dtype"]
    if not isinstance(dtype, str) or not _DTYPE_NAME.fullmatch(dtype):
        raise ValueError(f"input '{name}': dtype {_brief(dtype)} is not a dtype name")
    if "number" in data:
        lo, hi = data["number"]
        return InputRule(name, dtype, None, (_optional_int(lo), _optional_int(hi)))
    shape = tuple(_dim(d) if isinstance(d, str) else _int(d, low=0) for d in data["shape"])
    return InputRule(name, dtype, shape)


def _tree_json(tree: Sequence[Any]) -> list[Any]:
    if tree[0] in ("size", "num", "const"):
        return list(tree)
    return [tree[0], *(_tree_json(child) for child in tree[1:])]


def _tree_from(data: Any, inputs: Sequence[InputRule], budget: list[int], depth: int = 0) -> tuple:
    """A condition tree from JSON, checked: known ops with their arity, sizes of shaped inputs on
    axes they have, numbers of number inputs, int64 constants, bounded depth and node count."""
    budget[0] -= 1
    if not isinstance(data, list) or not data or depth > MAX_CONDITION_DEPTH or budget[0] < 0:
        raise ValueError(f"condition: expected a list of at most {MAX_CONDITION_DEPTH} levels and "
                         f"{MAX_CONDITION_NODES} nodes in all, got {_brief(data)}")
    kind, args = data[0], data[1:]
    if kind == "size" and len(args) == 2:
        index, axis = _index(args[0], inputs), _int(args[1], low=0)
        if inputs[index].shape is None or axis >= len(inputs[index].shape):
            raise ValueError(f"condition: input '{inputs[index].name}' has no axis {axis}")
        return ("size", index, axis)
    if kind == "num" and len(args) == 1:
        index = _index(args[0], inputs)
        if inputs[index].shape is not None:
            raise ValueError(f"condition: input '{inputs[index].name}' is not a number")
        return ("num", index)
    if kind == "const" and len(args) == 1:
        return ("const", _scalar(args[0]))
    fewest, most = ARITY.get(kind, (2, 2)) if isinstance(kind, str) and kind in OPS else (1, 0)
    if fewest <= len(args) <= most:
        return (kind, *(_tree_from(child, inputs, budget, depth + 1) for child in args))
    raise ValueError(f"condition: unknown node {_brief(kind)} with {len(args)} argument(s)")


def _index(value: Any, inputs: Sequence[InputRule]) -> int:
    index = _int(value, low=0)
    if index >= len(inputs):
        raise ValueError(f"condition: input {index} out of range ({len(inputs)} inputs)")
    return index


def _int(value: Any, low: int = _INT64[0]) -> int:
    """An int within int64 (and at least ``low``): what a size or a number in the graph can be."""
    if type(value) is not int or not low <= value <= _INT64[1]:
        raise ValueError(f"expected an int in [{low}, {_INT64[1]}], got {_brief(value)}")
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a name, got {_brief(value)}")
    return value


def _dim(value: Any) -> str:
    """A dim name: ``#`` starts the names of lifted numbers where sizes are recorded, so none may."""
    if _name(value).startswith(NUMBER_PREFIX):
        raise ValueError(f"dim name {_brief(value)} starts with '{NUMBER_PREFIX}'")
    return value


def _scalar(value: Any) -> Any:
    if isinstance(value, bool) or (type(value) is int and _INT64[0] <= value <= _INT64[1]):
        return value
    raise ValueError(f"expected an int64 or a bool, got {_brief(value)}")


def _outcome(value: Any) -> Any:
    """A verified point's condition value: also ``None``, a condition undefined there (``outcomes``)."""
    return None if value is None else _scalar(value)


def _brief(value: Any) -> str:
    """A hostile value in an error message: short, and never a deep repr (which could recurse)."""
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    if type(value) is int and value.bit_length() > 64:  # repr of a huge int is slow, or refused
        return f"an int of {value.bit_length()} bits"
    return repr(value)[:40] if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
