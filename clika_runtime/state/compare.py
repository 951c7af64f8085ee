"""One watched container of a target's Python state (a ``Part``), and how it compares now.

A part holds what its watched entries were at capture (``kept``: a copy of a container three
levels deep when it holds up to ``COPIED`` items in all; past that, the object itself). Values
compare by ``==`` (identity first): ``2`` re-assigned as ``2.0`` is no change. ``differences``
names the entries that moved, ``word`` says one in words, ``reread`` takes the values as they are
now, ``without`` leaves out the entries a target writes itself.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

COPIED = 64  # containers up to this many items are compared by value, larger ones by identity
# The private entries of a module's __dict__ that change what a call computes (a hook's flags,
# "with kwargs" and "always called", are only ever set beside its entry in these), compared
# whole when torch's registration counter or hook count moves: a tensor where ``None`` was, a
# buffer registered later, a tied weight given its own.
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
MODULE_PRIVATE = ("_modules", *MODULE_HOOKS, "_parameters", "_buffers")
_PRIVATE_WORDS = {"_modules": "submodules", "_parameters": "parameters", "_buffers": "buffers"}
# A bare module's own private entries (parameters, buffers, hooks' flags): torch's bookkeeping.
MODULE_INTERNALS = frozenset(k for k in vars(torch.nn.Module()) if k.startswith("_"))
_contents = operator.attrgetter("cell_contents")


@dataclass(frozen=True)
class Part:
    """One watched container: what it is called, how its watched values are read, what they were at capture."""

    name: str  # "encoder.layer.0", "config", "the closure of f"
    container: Any
    keys: tuple[str, ...]  # the watched entries, in the order ``read`` returns them
    read: Callable[[Any], Any] | None  # container -> the watched values (one key: its value)
    values: tuple
    size: int | None  # len(container) at capture (None: not compared)
    known: frozenset[str] = frozenset()  # every key the container had at capture (dictionaries)
    variables: bool = False  # entries are a function's variables ("global 'SCALE'"), not attributes
    per_call: bool = True  # False: compared only when a counter says it may have moved (submodules, hooks)
    trigger: bool = False  # only says that the others must be compared (a count of hooks): never a change
    hidden: frozenset[str] = frozenset()  # a module's private keys: watched only where the captures' code names them
    only: frozenset[str] | None = None  # the names the captures' code names (``reads.py``): no other key added is a change


def dict_part(name: str, state: dict, keys: list[str], *, sized: bool, whole: bool = False) -> Part:
    """``keys`` of ``state``; ``whole``: their values are dictionaries copied whatever their size
    (a module's children and hooks: a swap in a 100-layer list must show)."""
    values = tuple(dict(state[k]) if whole else kept(state[k]) for k in keys)
    if not keys:
        return Part(name, state, (), None, (), len(state) if sized else None, frozenset(state))
    return Part(name, state, tuple(keys), operator.itemgetter(*keys), values, len(state) if sized else None,
                frozenset(state))


def _cells(cells: tuple) -> tuple:
    return tuple(map(_contents, cells))


def cells_part(cells: tuple, names: tuple[str, ...]) -> Part:
    """A function's filled closure cells, by their variables' ``names``."""
    one = len(cells) == 1  # one cell is read alone: a getter of one key gives the value itself
    return Part("closed-over", cells[0] if one else cells, names, _contents if one else _cells,
                tuple(kept(c.cell_contents) for c in cells), None, variables=True)


def kept(value: Any, depth: int = 3) -> Any:
    """What to keep of ``value``: a copy of a small container, ``depth`` levels down (it may
    change in place), when it holds at most ``COPIED`` items in all (compared on every call);
    a tuple only when something in it was copied."""
    if depth == 0 or not isinstance(value, (dict, list, set, tuple)) or _items(value, depth) > COPIED:
        return value
    return _copied(value, depth)


def _items(value: Any, depth: int) -> int:
    """How many items ``value`` holds, ``depth`` levels down (counting stops past ``COPIED``)."""
    if depth == 0 or not isinstance(value, (dict, list, set, tuple)):
        return 0
    total = len(value)
    for item in value.values() if isinstance(value, dict) else value:
        if total > COPIED:
            break
        total += _items(item, depth - 1)
    return total


def _copied(value: Any, depth: int) -> Any:
    if depth == 0 or not isinstance(value, (dict, list, set, tuple)):
        return value
    if isinstance(value, dict):
        return {k: _copied(v, depth - 1) for k, v in value.items()}
    # A subclass (``class Scales(list)``, a named tuple) as its base: kept by reference, a change in
    # place compared equal to itself and served the old graph.
    base = next(b for b in (list, set, tuple) if isinstance(value, b))
    copied = base(_copied(v, depth - 1) for v in value)
    return value if base is tuple and all(a is b for a, b in zip(copied, value)) else copied


def differences(part: Part, same: Callable[[Any, Any], bool] | None = None) -> list[str]:
    """The keys of ``part`` whose values differ (``same``: how two values compare, ``_same`` by
    default), and public keys added since."""
    same = same or _same
    if part.trigger:
        return []
    try:
        now = part.read(part.container) if part.read is not None else ()
        now = (now,) if len(part.keys) == 1 else now  # a getter of one key gives the value itself
    except Exception:  # an entry deleted, a cell emptied
        if not isinstance(part.container, dict):
            return list(part.keys)
        gone = object()  # a dictionary: the entries deleted, and those that differ
        now = tuple(part.container.get(key, gone) for key in part.keys)
    found = [key for key, old, new in zip(part.keys, part.values, now) if not same(old, new)]
    if part.size is not None and len(part.container) != part.size:
        found += [key for key in part.container if key not in part.known
                  and (not key.startswith("_") if part.only is None else key in part.only)]
    return found


def reread(part: Part) -> Part:
    """``part`` with its values, size and keys as they are now (entries deleted since: left out;
    a lazy module deletes its set-up hooks on its first call)."""
    if isinstance(part.container, dict) and any(k not in part.container for k in part.keys):
        part = without(part, frozenset((part.name, k) for k in part.keys if k not in part.container)) or \
            replace(dict_part(part.name, part.container, [], sized=part.size is not None), per_call=part.per_call)
    now = part.read(part.container) if part.read is not None else ()
    now = (now,) if len(part.keys) == 1 else tuple(now)
    whole = bool(part.keys) and all(k in MODULE_PRIVATE for k in part.keys)
    container = part.container
    return replace(part, values=tuple(dict(v) if whole else kept(v) for v in now),
                   size=len(container) if part.size is not None else None,
                   known=frozenset(container) if isinstance(container, dict) else part.known)


def without(part: Part, skip: frozenset[tuple[str, str]]) -> Part | None:
    """``part`` without the keys in ``skip``, the others' values as recorded; a part that is not a
    dictionary is left out whole."""
    left = [key for key in part.keys if (part.name, key) not in skip]
    if len(left) == len(part.keys):
        return part
    if part.read in (_contents, _cells):  # a closure: its other cells stay watched
        cells = (part.container,) if len(part.keys) == 1 else part.container
        kept_cells = [(cell, key, value) for cell, key, value in zip(cells, part.keys, part.values) if key in left]
        if not kept_cells:
            return None
        fewer = cells_part(tuple(c for c, _, _ in kept_cells), tuple(k for _, k, _ in kept_cells))
        return replace(fewer, values=tuple(v for _, _, v in kept_cells))
    if not isinstance(part.container, dict):
        return None
    return replace(subset(part, left), hidden=part.hidden & set(left))


def subset(part: Part, keys: list[str]) -> Part:
    """``part`` watching only ``keys`` (some of its own), with the values, size and keys it
    recorded: not read again, so a change made since (another thread's) is still a change."""
    recorded = dict(zip(part.keys, part.values))
    return replace(part, keys=tuple(keys), read=operator.itemgetter(*keys) if keys else None,
                   values=tuple(recorded[key] for key in keys))


def word(part: Part, key: str) -> str:
    if part.variables:
        return f"{part.name} '{key.strip('_')}'"
    if key in MODULE_PRIVATE:
        what = _PRIVATE_WORDS.get(key, "forward hooks")
        return f"{what} of {part.name}" if part.name == "the module" else f"{what} of '{part.name}'"
    return f"'{key}'" if part.name == "the module" else f"'{part.name}.{key}'"


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    copied_subclass = type(old) in (list, set, tuple) and isinstance(new, type(old))  # kept as its base (_copied)
    if isinstance(old, (dict, list, set, tuple, str, bytes, int, float, complex, bool)) and (
            type(old) is type(new) or copied_subclass):
        try:
            return bool(old == new)
        except Exception:  # containers holding arrays or tensors: not comparable by value
            return False
    return isinstance(new, dict) and isinstance(old, dict) and _dicts_same(old, new)


def same_untraced(old: Any, new: Any) -> bool:
    """``_same`` that never compares a tensor by value: values holding one are the same only when
    they are one object. For use inside a trace, where a parameter is a fake tensor: comparing it
    (a dictionary's ``==`` calls ``bool()`` on its entries) would add to the trace."""
    return old is new or (not _holds_tensor(old) and not _holds_tensor(new) and _same(old, new))


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if type(value) is dict:
        return any(map(_holds_tensor, value.values()))
    return type(value) in (list, tuple, set) and any(map(_holds_tensor, value))


def _dicts_same(old: dict, new: dict) -> bool:
    return old.keys() == new.keys() and all(_same(old[k], new[k]) for k in old)
