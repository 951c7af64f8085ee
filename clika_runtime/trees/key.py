"""The cache key of a call, computed in one place, and why a call missed, in words.

A call is flattened to leaves. Tensors (and Python numbers lifted to graph inputs) feed the
graph; every other leaf is static and joins the key by value. The key holds the call's structure,
each static leaf's value, each fed tensor's dtype, rank and device (and shape when shapes are part
of the key), where among the leaves the tensors are, and the owning module's training flag.
``explain`` words why a call missed against the closest cached key, as jax does.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import threading
import types
import weakref
from math import copysign
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np
import torch

from clika_runtime.base.libraries import code_name

_Tensor = torch.Tensor
_PLAIN_TENSORS = (torch.nn.Parameter,)  # subclasses that compute as plain tensors do


class CallKey(NamedTuple):
    """What decides which captures may serve a call (compared with ``==``, hashed as a tuple)."""

    structure: Any  # the optree PyTreeSpec of the call in its canonical form
    statics: tuple  # per static leaf, its value (``static_value``); per lifted number, ``LIFTED[type]``
    tensors: tuple  # per fed tensor: (dtype, rank, device) or (dtype, rank, device, shape)
    training: bool | None  # the owning module's training flag (None: no module)
    tensor_at: tuple = ()  # the positions of the tensor leaves among all (``f(x, 0.5)`` is not ``f(0.5, x)``)

    # A structure's dict keys compare by ``==``: ``{1: x}``, ``{True: x}`` and ``{1.0: x}`` are one
    # PyTreeSpec to optree, but not one call to a target that reads the keys (or rebuilds them). Keys
    # equal as tuples are told apart by the structure's text, compared only when a structure holds a
    # key that is not a ``str`` (``odd_keys``, once per structure object): the lookup of the usual
    # call costs one Python ``__eq__`` more than the tuple's.
    def __eq__(self, other: object) -> bool:
        if type(other) is not CallKey:
            return NotImplemented  # type: ignore[return-value]
        if not tuple.__eq__(self, other):
            return False
        a, b = self.structure, other.structure  # type: ignore[attr-defined]
        return a is b or not odd_keys(a) or str(a) == str(b)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__


_ODD: dict[int, bool] = {}  # id(structure) -> whether it holds a dict key other than a str


def odd_keys(structure: Any) -> bool:
    """Whether ``structure`` (a PyTreeSpec) holds a dict key that is not exactly a ``str``,
    remembered for the structure object's life."""
    ident = id(structure)
    try:
        return _ODD[ident]
    except KeyError:
        pass
    odd = _has_odd_keys(structure)
    try:
        weakref.finalize(structure, _ODD.pop, ident, None)
    except TypeError:  # not weak-referenceable: not remembered
        return odd
    _ODD[ident] = odd
    return odd


def _has_odd_keys(structure: Any) -> bool:
    try:
        pending = [structure]
        while pending:
            spec = pending.pop()
            if spec.is_leaf():
                continue
            if spec.type is not None and issubclass(spec.type, dict):
                if any(type(k) is not str for k in spec.entries()):
                    return True
            pending.extend(spec.children())
        return False
    except Exception:  # a structure optree cannot walk: its text decides
        return True


class Unkeyable(Exception):
    """A static leaf whose value cannot key a capture; the message says why."""


class Lifted(NamedTuple):
    """The static entry of a Python number fed to the graph: only its type joins the key."""

    type: type


_NAN = ("nan",)
# Leaves keyed by their type and value as they are: immutable, compared by value.
_PLAIN = frozenset({type(None), bool, int, str, bytes, complex, type(Ellipsis), range, torch.dtype, torch.device,
                    torch.Size, torch.layout, torch.memory_format})
_NUMPY_SCALARS = (np.generic,)  # np.float32(0.7), np.int64(3): numbers, keyed by their value
# Code and classes: immutable in practice, so identity is their value (as torch.compile guards them).
_BY_IDENTITY = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
                types.BuiltinMethodType)
# A subclass of a value type holds its value in its base, not in its attributes: how to read it.
_VALUE_BASES: dict[type, Callable[[Any], Any]] = {
    bool: bool.__bool__, int: int.__int__, float: float.__float__, str: str.__str__,
    bytes: lambda v: bytes(memoryview(v)), complex: lambda v: complex(v.real, v.imag),
}
_BY_VALUE_DEPTH = 4
_INERT = (type(threading.Lock()), type(threading.RLock()), threading.Event, threading.Condition, logging.Logger)
_BY_VALUE_ITEMS = 64


def static_value(leaf: Any) -> Hashable:
    """A static leaf as it joins the key: its type with its value (``1``, ``1.0`` and ``True``
    differ; NaN equals NaN; ``-0.0`` is not ``0.0``).

    Value types (numbers, str, bytes, None, enums, dtypes, frozen dataclasses of them) key by
    value; functions and classes by identity; any other object by the value of its attributes,
    read again on every call, so a changed attribute is a new key. Raises ``Unkeyable`` for an
    object that cannot be keyed by value (it holds tensors, modules, or too much).
    """
    kind = type(leaf)
    if kind in _PLAIN:
        return (kind, leaf)
    if kind is float:
        return (kind, leaf, copysign(1.0, leaf)) if leaf == leaf else (kind, _NAN)
    if isinstance(leaf, (enum.Enum, *_BY_IDENTITY)):
        return (kind, leaf)
    if isinstance(leaf, Unkeyable):  # a node that refuses to be keyed says why (kvcache.Refused)
        raise Unkeyable(str(leaf))
    if isinstance(leaf, (_Tensor, torch.nn.Module)):
        raise Unkeyable(f"a {kind.__name__} passed where only tensor leaves feed the graph")
    if isinstance(leaf, _NUMPY_SCALARS):  # np.float32(0.7): a number, keyed as one with its type
        return (kind, static_value(leaf.item()))
    if kind.__hash__ is None and not dataclasses.is_dataclass(leaf):  # (a mutable dataclass: by value)
        raise Unkeyable(f"static input leaf of unhashable type {kind.__name__} cannot key a capture")
    return ("snapshot", kind, _by_value(leaf, _BY_VALUE_DEPTH))  # the tag stays: disk-cache keys hold it


def _by_value(value: Any, depth: int) -> Hashable:
    """The value of a mutable object as nested tuples, or ``Unkeyable``."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, (enum.Enum, *_BY_IDENTITY)):
        return (kind, value)  # with its type: 1, True and an IntEnum of 1 compare equal
    if kind is float:
        return static_value(value)
    if depth == 0:
        raise Unkeyable(f"a {kind.__name__} nested too deep to compare by value")
    if isinstance(value, (_Tensor, torch.nn.Module)):
        raise Unkeyable(f"an object holding a {kind.__name__}, whose value cannot key a capture")
    if isinstance(value, _NUMPY_SCALARS):  # np.float32(0.7) inside a config: a number, as at the top
        return (kind, _by_value(value.item(), depth - 1))
    base = next((b for b in _VALUE_BASES if isinstance(value, b)), None)
    if base is not None:  # Scale(5.0): its number is its base's, not in its attributes
        return (kind, _by_value(_VALUE_BASES[base](value), depth - 1), _attributes(value, kind, depth, empty_ok=True))
    if isinstance(value, functools.partial):  # its function and arguments are slots, not attributes
        return (kind, _by_value(value.func, depth - 1), _by_value(value.args, depth - 1),
                _by_value(value.keywords, depth - 1), _attributes(value, kind, depth, empty_ok=True))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (kind, tuple(_by_value(v, depth - 1) for v in _capped(items, kind)))
    if isinstance(value, dict):  # keys by type too: {1: ...} and {True: ...} are one dict to ==
        return (kind, tuple((_by_value(k, depth - 1), _by_value(v, depth - 1)) for k, v in _capped(value.items(), kind)))
    if dataclasses.is_dataclass(value):  # its fields, and what __post_init__ set from an InitVar
        names = {f.name for f in dataclasses.fields(value)}
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        fields += [(k, v) for k, v in getattr(value, "__dict__", {}).items() if k not in names and _kept(kind, k, v)]
        return (kind, tuple((k, _by_value(v, depth - 1)) for k, v in _capped(fields, kind)))
    return (kind, _attributes(value, kind, depth))


def _kept(kind: type, name: str, value: Any) -> bool:
    """Whether a dataclass's attribute beyond its fields is part of its value: not a
    ``cached_property``'s (made from the fields, and filled by a first call: keyed, it re-captured
    once, and a large one left the call unkeyable), nor a lock or a logger set up beside them."""
    return not isinstance(getattr(kind, name, None), functools.cached_property) and not isinstance(value, _INERT)


def _attributes(value: Any, kind: type, depth: int, empty_ok: bool = False) -> tuple:
    """An object's attributes (its ``__dict__`` and ``__slots__``) by value, as (name, value) pairs."""
    slots = [name for cls in kind.__mro__ for name in _slot_names(cls) if name not in ("__dict__", "__weakref__")]
    state = [*getattr(value, "__dict__", {}).items(), *((n, getattr(value, n)) for n in slots if hasattr(value, n))]
    if not state and not empty_ok and not hasattr(value, "__dict__"):
        raise Unkeyable(f"a {kind.__name__} has no attributes to compare by value")
    return tuple((k, _by_value(v, depth - 1)) for k, v in _capped(state, kind))


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    # ``__x`` in a class body is stored as ``_Class__x``: read under its own name, it reads as unset
    return tuple(f"_{cls.__name__.lstrip('_')}{n}" if n.startswith("__") and not n.endswith("__") else n for n in names)


def _capped(items: Any, kind: type) -> list:
    items = list(items)
    if len(items) > _BY_VALUE_ITEMS:
        raise Unkeyable(f"a {kind.__name__} with {len(items)} entries is too large to compare by value on every call")
    return items


def split(
    leaves: Sequence[Any], lifted: frozenset[int], with_shapes: bool
) -> tuple[list[Any], tuple, tuple, bool, tuple]:
    """One pass over a call's leaves: the fed leaves (tensors, lifted numbers), the static part of
    the key, each fed tensor's dtype/rank/device (and shape), whether a fed tensor requires grad,
    and the tensors' positions among the leaves.

    Raises ``Unkeyable`` (from ``static_value``) for a static leaf that cannot key a capture.
    """
    feeds = []
    statics = []
    metas = []
    tensor_at = []
    grad = False
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor):
            tensor_at.append(i)
            if type(leaf) is not _Tensor and type(leaf) not in _PLAIN_TENSORS:
                raise Unkeyable(f"a {type(leaf).__name__} (a tensor subclass: its operations are its own, "
                                "and eager returns it) cannot feed a graph; pass x.as_subclass(torch.Tensor) "
                                "to have such calls served")
            feeds.append(leaf)
            shape = leaf.shape
            metas.append((leaf.dtype, len(shape), leaf.device, shape) if with_shapes else (leaf.dtype, len(shape), leaf.device))
            grad = grad or leaf.requires_grad
        elif lifted and i in lifted:
            feeds.append(leaf)
            statics.append(Lifted(type(leaf)))
        else:
            statics.append(static_value(leaf))
    return feeds, tuple(statics), tuple(metas), grad, tuple(tensor_at)


# ------------------------------------------------------------------------------------------ explain


class Described(NamedTuple):
    """A key with the names that make its difference from another key readable."""

    key: CallKey
    paths: tuple[str, ...]  # every leaf's path, in leaf order (``x``, ``batch['ids']``)
    static_names: tuple[str, ...]  # the static leaves' names, in order
    tensor_names: tuple[str, ...]  # the fed tensors' names, in order

    def words(self) -> str:
        """The key in words, as ``f.captures`` shows it: ``x: float32 on cpu, mode='relu', eval``."""
        key = self.key
        parts = [f"{name}: {str(dtype).replace('torch.', '')} on {device}"
                 for name, (dtype, _, device, *_) in zip(self.tensor_names, key.tensors)]
        parts += [f"{name}={_value(static)}" for name, static in zip(self.static_names, key.statics)
                  if not isinstance(static, Lifted)]
        if key.training is not None:
            parts.append("training" if key.training else "eval")
        return ", ".join(parts)


def distance(a: CallKey, b: CallKey) -> int:
    """How far two keys are: a new structure is furthest, then each differing part counts one."""
    if a.structure != b.structure or (odd_keys(a.structure) and str(a.structure) != str(b.structure)):
        return 1000
    statics = sum(x != y for x, y in zip(a.statics, b.statics))
    tensors = sum(x != y for x, y in zip(a.tensors, b.tensors))
    moved = (a.training != b.training) + (a.tensor_at != b.tensor_at)
    return statics + tensors + moved + abs(len(a.tensors) - len(b.tensors))


def closest(candidates: Sequence[Described], key: CallKey) -> Described | None:
    """The candidate nearest to ``key`` (the most recent among equals: candidates in age order)."""
    best, best_distance = None, None
    for candidate in candidates:
        d = distance(candidate.key, key)
        if best_distance is None or d <= best_distance:
            best, best_distance = candidate, d
    return best


def explain(old: Described, new: Described) -> str:
    """Why ``new`` is a different key from ``old``, in words: the first difference found."""
    if old.key.structure != new.key.structure:
        return f"new structure: {_structure_change(old, new)}"
    if str(old.key.structure) != str(new.key.structure):
        return f"new structure: dict keys of another type ({old.key.structure} -> {new.key.structure})"
    if old.key.training != new.key.training:
        return f"module training flag changed: {old.key.training} -> {new.key.training}"
    # By name: a leaf that was a tensor and is now static (mask=None) shifts the others' positions.
    old_statics, new_statics = dict(zip(old.static_names, old.key.statics)), dict(zip(new.static_names, new.key.statics))
    old_tensors, new_tensors = dict(zip(old.tensor_names, old.key.tensors)), dict(zip(new.tensor_names, new.key.tensors))
    for name in new.paths:
        if name in old_tensors and name in new_statics:
            return f"input '{name}' changed: a {_dtype(old_tensors[name])} tensor -> {_value(new_statics[name])}"
        if name in old_statics and name in new_tensors:
            return f"input '{name}' changed: {_value(old_statics[name])} -> a {_dtype(new_tensors[name])} tensor"
    for name, b in new_statics.items():
        if name in old_statics and old_statics[name] != b:
            return f"static value changed: '{name}' {_value(old_statics[name])} -> {_value(b)}"
    for name, b in new_tensors.items():
        if name in old_tensors and old_tensors[name] != b:
            return f"input '{name}' changed: {_meta(old_tensors[name])} -> {_meta(b)}"
    return "new key"


def _structure_change(old: Described, new: Described) -> str:
    appeared = [p for p in new.paths if p not in old.paths]
    gone = [p for p in old.paths if p not in new.paths]
    parts = []
    if appeared:
        parts.append(f"{_listed(appeared)} appeared")
    if gone:
        parts.append(f"{_listed(gone)} gone")
    if parts:
        return "; ".join(parts)
    retyped = _retyped(old.key.structure, new.key.structure, 0)
    if retyped is not None:  # the same leaves in other containers: f([a, b]) then f((a, b))
        was, now, start, count = retyped
        return f"a {was} became a {now} (holding {_listed(new.paths[start:start + count])})"
    return f"the inputs were rearranged: {_listed(old.paths)} -> {_listed(new.paths)}"


def _retyped(old: Any, new: Any, start: int) -> tuple[str, str, int, int] | None:
    """The first container whose type differs between two specs with the same leaves: its old and
    new type names, where its leaves start, and how many it holds."""
    if old.type is not new.type:
        return _type_name(old.type), _type_name(new.type), start, new.num_leaves
    if old.num_children != new.num_children:
        return None
    for a, b in zip(old.children(), new.children()):
        found = _retyped(a, b, start)
        if found is not None:
            return found
        start += b.num_leaves
    return None


def _type_name(node_type: Any) -> str:
    return "leaf" if node_type is None else node_type.__name__


def _listed(paths: Sequence[str]) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:4])
    return shown + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def _value(static: Any) -> str:
    if isinstance(static, Lifted):
        return f"<{static.type.__name__} graph input>"
    return _shortened(_words(static))


def _shortened(text: str) -> str:
    return text if len(text) < 80 else text[:77] + "..."


def _words(static: Any) -> str:
    """A static entry (``static_value``'s or ``_by_value``'s form) written as the value it stands for."""
    if static[0] == "snapshot":
        return _words(static[2])
    kind, rest = static[0], static[1:]
    if kind is float:
        return "nan" if rest[0] == _NAN else repr(rest[0])
    if isinstance(kind, type) and issubclass(kind, _NUMPY_SCALARS):
        return f"np.{kind.__name__}({_words(rest[0])})"
    if isinstance(kind, type) and issubclass(kind, _BY_IDENTITY):  # by name: its address differs per process
        return code_name(rest[0])
    if not isinstance(kind, type) or kind in _PLAIN or issubclass(kind, enum.Enum):
        return repr(rest[0])
    if issubclass(kind, tuple(_VALUE_BASES)):  # Scale(5.0)
        return f"{kind.__name__}({_words(rest[0])}{_fields(rest[1])})"
    if issubclass(kind, functools.partial):
        func, args, keywords = rest[0], rest[1][1], rest[2][1]
        parts = [_words(func), *map(_words, args), *(f"{k[1]}={_words(v)}" for k, v in keywords)]
        return f"{kind.__name__}({', '.join(parts)}{_fields(rest[3])})"
    items = rest[0]
    if issubclass(kind, (list, tuple, set, frozenset)):
        inner = ", ".join(_words(v) for v in items)
        plain = {list: f"[{inner}]", tuple: f"({inner}{',' if len(items) == 1 else ''})",
                 set: f"{{{inner}}}" if items else "set()", frozenset: f"frozenset({{{inner}}})"}
        return plain.get(kind, f"{kind.__name__}({inner})")
    if issubclass(kind, dict):
        return "{" + ", ".join(f"{_words(k)}: {_words(v)}" for k, v in items) + "}"
    return f"{kind.__name__}(" + ", ".join(f"{k}={_words(v)}" for k, v in items) + ")"  # a dataclass or object


def _fields(attributes: tuple) -> str:
    return "".join(f", {k}={_words(v)}" for k, v in attributes)


def _dtype(meta: tuple) -> str:
    return str(meta[0]).replace("torch.", "")


def _meta(meta: tuple) -> str:
    dtype, rank, device, *shape = meta
    text = f"{str(dtype).replace('torch.', '')} rank {rank} on {device}"
    return text + (f" shape {tuple(shape[0])}" if shape else "")
