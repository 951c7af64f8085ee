"""Pytree descriptions: the JSON form of a captured call's and output's trees, stored in a shipped
graph's metadata and rebuilt in pure Python, so a box without torch or optree serves the same trees.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict, deque
from typing import Any, Iterator

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
            "type": f"{cls.__module__}:{cls.__qualname__}" if cls is not None else "builtins:NoneType",
            "keys": [e if isinstance(e, (str, int)) else str(e) for e in node.entries()],
            "children": [walk(child) for child in node.children()],
        }

    return walk(spec)


def static_leaf(value: Any) -> dict[str, Any]:
    """Description of a static input leaf: its value when JSON holds it, else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "const", "value": value}
    return {"kind": "static", "repr": repr(value)}


def _import(qualified: str) -> type | None:
    module, _, name = qualified.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj if isinstance(obj, type) else None
    except Exception:  # the class is not importable here: rebuild as a plain container
        return None


def rebuild(description: dict[str, Any], leaves: Iterator[Any]) -> Any:
    """Rebuild a described tree from leaves in flattening order (classes imported when possible)."""
    kind = description["kind"]
    if kind == "leaf":
        return next(leaves)
    if kind == "scalar":  # a Python number the graph computes (a size), returned as one
        return {"int": int, "float": float, "bool": bool}[description["type"]](next(leaves).item())
    if kind == "const":
        return description["value"]
    if kind == "none":
        return None
    children = [rebuild(child, leaves) for child in description["children"]]
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
    cls = _import(description["type"])
    if kind in ("namedtuple", "structseq"):
        return cls(children) if kind == "structseq" and cls else (cls(*children) if cls else tuple(children))
    if cls is not None:
        try:
            return cls(**dict(zip(keys, children)))
        except Exception:  # a custom node whose constructor takes other arguments
            pass
    return dict(zip(map(str, keys), children))


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
            elif kind in ("tuple", "list", "deque", "namedtuple", "structseq"):
                value = list(tree)[int(key)] if isinstance(key, int) else getattr(tree, key)
            else:
                value = tree[key] if hasattr(tree, "__getitem__") and isinstance(key, str) else getattr(tree, str(key))
        except (KeyError, IndexError, AttributeError, TypeError):
            raise ValueError(
                f"input {sub}: missing; expected a {kind} with entries {keys}, got {type(tree).__name__}"
            ) from None
        yield from flatten_described(child, value, sub)
    if hasattr(tree, "__len__") and len(tree) != len(keys):
        raise ValueError(f"input {path or 'root'}: expected {len(keys)} entries {keys}, got {len(tree)}")
