"""Pytree descriptions: the JSON form of a captured call's and output's trees, stored in a shipped
graph's metadata and rebuilt in pure Python, so a box without torch or optree serves the same trees.

A description names classes (``"module:Qualname"``) but never decides what runs: rebuilding uses
built-in containers, and classes the *caller* allows by name (node types this process registered
with torch's pytree, and the ``output_types`` given to ``cr.load``). No module is imported and no
other class is called; a class that is not allowed comes back as a plain tuple or dict, with one
line on the ``clika_runtime`` logger. A node naming an allowed class is checked at load time
against the class (``check_types``: a namedtuple's length, a structseq's field counts, the
keywords a signature takes), so a description cannot make the call fail on that account.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections import OrderedDict, deque
from typing import Any, Iterable, Iterator, Mapping

logger = logging.getLogger("clika_runtime")

MAX_DEPTH = 64
MAX_NODES = 100_000
# optree's node kinds, as ``describe`` writes them (``PyTreeKind`` names, lower case).
_CONTAINERS = {"tuple", "list", "dict", "defaultdict", "ordereddict", "deque", "namedtuple", "structsequence", "custom"}
_LEAVES = {"leaf", "const", "static", "scalar", "none"}
_CALLED = {"namedtuple", "structsequence", "custom"}  # kinds rebuilt by calling the class named
SCALAR_TYPES = {"int": int, "float": float, "bool": bool}  # a Python number by its type's name


def describe(spec: Any, leaves: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A JSON-able description of an optree ``PyTreeSpec``, enough to rebuild it without torch or optree.

    ``leaves`` maps leaf positions to their own description (default ``{"kind": "leaf"}``): a
    baked constant, a static value, a Python int computed by the graph...
    """
    leaves = leaves or {}
    counter = iter(range(spec.num_leaves))

    def walk(node: Any) -> dict[str, Any]:
        if node.is_leaf():
            return leaves.get(next(counter), {"kind": "leaf"})
        cls = node.type
        return {
            "kind": node.kind.name.lower(),
            "type": type_name(cls) if cls is not None else "builtins:NoneType",
            "keys": [e if isinstance(e, (str, int)) else str(e) for e in node.entries()],
            "children": [walk(child) for child in node.children()],
        }

    return walk(spec)


def type_name(cls: type) -> str:
    """How descriptions name a class: ``"module:Qualname"``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def static_leaf(value: Any) -> dict[str, Any]:
    """Description of a static input leaf: its value when JSON holds it, else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "const", "value": value}
    return {"kind": "static", "repr": repr(value)}


def validated(description: Any) -> dict[str, Any]:
    """``description`` checked node by node (known kinds, well-formed fields, bounded depth and
    size), or ``ValueError`` naming the path of the first problem."""
    count = [0]

    def check(node: Any, path: str, depth: int) -> None:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise ValueError(f"tree description at {path}: deeper than {MAX_DEPTH} or larger than {MAX_NODES} nodes")
        if not isinstance(node, dict) or not isinstance(node.get("kind"), str):
            raise ValueError(f"tree description at {path}: expected a node with a kind")
        kind = node["kind"]
        if kind in _LEAVES:
            _check_leaf(node, path)
            return
        if kind not in _CONTAINERS:
            raise ValueError(f"tree description at {path}: unknown kind {kind[:30]!r}")
        keys, children = node.get("keys"), node.get("children")
        if not isinstance(keys, list) or not isinstance(children, list) or len(keys) != len(children):
            raise ValueError(f"tree description at {path}: keys and children must be lists of one length")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys):
            raise ValueError(f"tree description at {path}: keys must be strings or ints")
        if not isinstance(node.get("type", ""), str):
            raise ValueError(f"tree description at {path}: type must be a string")
        for key, child in zip(keys, children):
            check(child, f"{path}[{key!r}]", depth + 1)

    check(description, "root", 0)
    return description


def _check_leaf(node: Mapping[str, Any], path: str) -> None:
    kind = node["kind"]
    if kind == "scalar" and not (isinstance(node.get("type"), str) and node["type"] in SCALAR_TYPES):
        raise ValueError(f"tree description at {path}: unknown scalar type {str(node.get('type'))[:30]!r}")
    if kind == "const" and ("value" not in node or not isinstance(node["value"], (type(None), bool, int, float, str))):
        raise ValueError(f"tree description at {path}: a constant needs a value: null, a bool, a number or a string")
    if kind == "static" and not isinstance(node.get("repr"), str):
        raise ValueError(f"tree description at {path}: a static value needs its repr")


def leaves(description: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The leaf nodes of a validated description, in flattening order."""
    if description["kind"] in _LEAVES:
        yield description
        return
    for child in description["children"]:
        yield from leaves(child)


def check_types(description: Mapping[str, Any], types: Mapping[str, type], path: str = "root") -> None:
    """``ValueError`` naming the first node of a validated description that names an allowed class
    (``types``) which cannot be called with that node's children: a namedtuple of another length,
    a structseq outside its field counts, a class whose signature takes other keywords."""
    kind = description["kind"]
    if kind in _LEAVES:
        return
    cls = types.get(description.get("type", "")) if kind in _CALLED else None
    if cls is not None and not _takes(cls, kind, description["keys"]):
        raise ValueError(f"tree description at {path}: {description['type'][:80]} cannot be rebuilt from a {kind} "
                         f"with entries {description['keys'][:20]}")
    for key, child in zip(description["keys"], description["children"]):
        check_types(child, types, f"{path}[{key!r}]")


def _takes(cls: type, kind: str, keys: list) -> bool:
    """Whether ``_node`` can call ``cls`` for a node of ``kind`` with these keys."""
    if kind == "namedtuple":
        return issubclass(cls, tuple) and len(getattr(cls, "_fields", ())) == len(keys)
    if kind == "structsequence":
        low, high = getattr(cls, "n_sequence_fields", None), getattr(cls, "n_fields", None)
        return issubclass(cls, tuple) and isinstance(low, int) and isinstance(high, int) and low <= len(keys) <= high
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a built-in without one: the call itself decides (served.py)
        return True
    try:
        signature.bind(**dict.fromkeys(map(str, keys)))
    except TypeError:
        return False
    return True


def allowed_types(extra: Iterable[type] = ()) -> dict[str, type]:
    """Classes an output tree may be rebuilt with, by description name: node types this process
    registered with torch's pytree (if torch is imported; it is never imported here), and ``extra``."""
    allowed: dict[str, type] = {}
    pytree = sys.modules.get("torch.utils._pytree")
    if pytree is not None:
        for cls in list(getattr(pytree, "SUPPORTED_NODES", {})):
            if isinstance(cls, type):
                allowed[type_name(cls)] = cls
    for cls in extra:
        if not isinstance(cls, type):
            raise TypeError(f"output_types: expected classes, got {cls!r}")
        allowed[type_name(cls)] = cls
    return allowed


def rebuild(description: dict[str, Any], leaves: Iterator[Any], types: Mapping[str, type]) -> Any:
    """Rebuild a validated tree from leaves in flattening order; only classes in ``types`` are
    called (with the description's keys), others come back as tuples or dicts."""
    kind = description["kind"]
    if kind == "leaf":
        return next(leaves)
    if kind == "scalar":  # a Python number the graph computes (a size), returned as one
        return SCALAR_TYPES[description["type"]](next(leaves).item())
    if kind == "const":
        return description["value"]
    if kind == "none":
        return None
    if kind == "static":  # an output constant JSON cannot hold: its repr is all the file has
        return description["repr"]
    children = [rebuild(child, leaves, types) for child in description["children"]]
    keys = description["keys"]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "deque":
        return deque(children)
    if kind in ("dict", "defaultdict"):
        return dict(zip(keys, children))
    if kind == "ordereddict":
        return OrderedDict(zip(keys, children))
    return _node(description, kind, keys, children, types)


def _node(description: Mapping[str, Any], kind: str, keys: list, children: list, types: Mapping[str, type]) -> Any:
    name = description.get("type", "")
    cls = types.get(name)
    if cls is None:
        logger.info("output node %s is not a registered pytree node nor in output_types: rebuilt as a %s",
                    name[:80], "tuple" if kind in ("namedtuple", "structsequence") else "dict")
        return tuple(children) if kind in ("namedtuple", "structsequence") else dict(zip(map(str, keys), children))
    if kind == "structsequence":
        return cls(children)
    if kind == "namedtuple":
        return cls(*children)
    return cls(**dict(zip(map(str, keys), children)))


def flatten_described(description: dict[str, Any], tree: Any, path: str = "") -> Iterator[tuple[str, Any, dict]]:
    """Walk ``tree`` along a description: yields (path, value, leaf description) per leaf.

    Raises ``ValueError`` naming the path where the structure differs. Pure Python: works where
    neither torch nor optree is installed.
    """
    kind = description["kind"]
    if kind in ("leaf", "const", "static", "scalar"):
        yield path, tree, description
        return
    if kind == "none":
        if tree is not None:
            raise ValueError(f"input {path or 'root'}: expected None, got {type(tree).__name__}")
        return
    keys, children = description["keys"], description["children"]
    for key, child in zip(keys, children):
        sub = f"{path}[{key!r}]" if path else str(key)
        try:
            if isinstance(tree, dict):
                value = tree[key]
            elif kind in ("tuple", "list", "deque", "namedtuple", "structsequence"):
                value = list(tree)[int(key)] if isinstance(key, int) else getattr(tree, key)
            else:
                value = tree[key] if hasattr(tree, "__getitem__") and isinstance(key, str) else getattr(tree, str(key))
        except (KeyError, IndexError, AttributeError, TypeError):
            raise ValueError(
                f"input {sub}: missing; expected a {kind} with entries {keys}, got {type(tree).__name__}"
            ) from None
        yield from flatten_described(child, value, sub)
    if hasattr(tree, "__len__") and len(tree) != len(keys):
        extra = [k for k in tree if k not in keys] if isinstance(tree, dict) else []
        if extra:  # most often an argument the capturing call left to its default
            raise ValueError(f"input {path or 'root'}: unexpected {extra}: the graph takes {keys}, the arguments of "
                             f"the call it was captured from (leave these out, or capture a call that passes them)")
        raise ValueError(f"input {path or 'root'}: expected {len(keys)} entries {keys}, got {len(tree)}")
