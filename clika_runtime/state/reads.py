"""Which attributes of the target's objects a capture's own runs read, so that the per-call
watch leaves out the rest: a request counter, the last latency, the last batch kept for
logging (bookkeeping the caller updates between calls) are no change of state.

While a capture's eager run and its trace last, each watched object of a class of the user's
own or of ``torch.nn`` wears a subclass of its class whose ``__getattribute__`` notes every
name asked of it, found or not (``getattr(self, "bias", 0.0)`` before ``bias`` exists is a read:
adding it later is a change); its own class is put back when they end, whatever happens. A
value never read cannot change what the call computed (what it reads decides every branch it
takes: the argument torch.compile's guards rest on), so what no capture read is not watched,
and what a capture read is, private attributes too (``self._scale`` behind a property).

Not seen, so such objects stay watched whole: a read through the object's ``__dict__`` from
the user's code (``vars(self)["gain"]``); objects of other libraries' classes (transformers'
configs translate names in a ``__getattribute__`` of their own, and its layers wrap ``forward``
in every subclass), whose public attributes stay watched as before.
"""

from __future__ import annotations

import contextvars
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from clika_runtime.base.libraries import ours
from clika_runtime.state.compare import Part, dict_part

# The names noted per watched object (by id) in this thread, one dictionary per capture running
# (a capture inside another's eager run notes for both).
_NOTING: contextvars.ContextVar[tuple[dict[int, set[str]], ...]] = contextvars.ContextVar("clika_runtime reads",
                                                                                          default=())
_WHOLE = "__dict__"  # a read of the whole dictionary: every attribute may matter
_OWN = ("torch.", "clika_runtime.", "exporters.")  # modules whose reads of __dict__ are bookkeeping


def _noting(self: Any, name: str) -> Any:
    for notes in _NOTING.get():
        seen = notes.get(id(self))
        if seen is not None and (name != _WHOLE or _users(sys._getframe(1))):
            seen.add(name)
    return object.__getattribute__(self, name)


def _users(frame: Any) -> bool:
    """Whether a read of ``__dict__`` comes from the user's code, not torch's ``Module.__getattr__``
    and ``__setattr__`` (which read it on every submodule access) or ours."""
    return not (frame.f_globals.get("__name__") or "").startswith(_OWN)


_NOTING_CLASSES: "weakref.WeakKeyDictionary[type, type | None]" = weakref.WeakKeyDictionary()


def _noting_class(cls: type) -> type | None:
    """``cls`` noting reads, made once per class; ``None`` for a class whose reads are not noted."""
    try:
        return _NOTING_CLASSES[cls]
    except KeyError:
        pass
    made = None
    if cls.__getattribute__ is object.__getattribute__ and (ours(cls) or cls.__module__.startswith("torch.nn.")):
        try:
            made = type(cls)(cls.__name__, (cls,), {"__getattribute__": _noting, "__slots__": (),
                                                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        except Exception:  # a metaclass or an __init_subclass__ that refuses: not noted
            made = None
    _NOTING_CLASSES[cls] = made
    return made


@dataclass(frozen=True)
class Reads:
    """The names the captures' runs read of each noted object, by the id of its ``__dict__`` (an
    object's attributes are watched there), with the object held weakly: an id whose object is
    gone, or not the one noted, is not used."""

    names: Mapping[int, tuple[Any, frozenset[str]]] = field(default_factory=lambda: MappingProxyType({}))

    def __or__(self, other: "Reads") -> "Reads":
        merged = dict(self.names)
        for key, (ref, names) in other.names.items():
            mine = merged.get(key)
            merged[key] = (ref, names | mine[1] if mine is not None and mine[0]() is ref() else names)
        return Reads(MappingProxyType(merged))

    def of(self, container: Any) -> frozenset[str] | None:
        """The names read of the object whose dictionary is ``container`` (``None``: not noted)."""
        entry = self.names.get(id(container))
        if entry is None:
            return None
        holder = entry[0]()
        if holder is None or object.__getattribute__(holder, "__dict__") is not container or _WHOLE in entry[1]:
            return None
        return entry[1]


def narrowed(part: Part, reads: Reads) -> Part:
    """``part`` watching what the captures read of its object, private attributes included, and
    not what they did not; an object whose reads were not noted keeps its public attributes."""
    if part.size is None:  # not an object's attributes
        return part
    names = reads.of(part.container)
    if names is None:
        return _kept(part, [k for k in part.keys if k not in part.hidden], None) if part.hidden else part
    return _kept(part, [k for k in part.keys if k in names], names)


def _kept(part: Part, keys: list[str], only: frozenset[str] | None) -> Part:
    fewer = dict_part(part.name, part.container, keys, sized=True)
    return replace(fewer, variables=part.variables, per_call=part.per_call, only=only)


@contextmanager
def noted(holders: Mapping[int, Any]) -> Iterator[dict[int, set[str]]]:
    """Note the names asked of ``holders`` (by their dictionaries' ids) in this thread while the
    block runs; what is noted is in the dictionary yielded, by the objects' ids."""
    notes: dict[int, set[str]] = {}
    worn: list[tuple[Any, type]] = []
    try:
        for holder in holders.values():
            cls = type(holder)
            noting = _noting_class(cls)
            if noting is None or id(holder) in notes:
                continue
            try:
                object.__setattr__(holder, "__class__", noting)
            except TypeError:  # a layout __class__ assignment refuses
                continue
            worn.append((holder, cls))
            notes[id(holder)] = set()
        token = _NOTING.set(_NOTING.get() + (notes,))
        try:
            yield notes
        finally:
            _NOTING.reset(token)
    finally:
        for holder, cls in worn:
            object.__setattr__(holder, "__class__", cls)


def read(holders: Mapping[int, Any], notes: dict[int, set[str]]) -> Reads:
    """What ``noted`` saw, as ``Reads`` (objects it could not note are left out)."""
    found = {}
    for key, holder in holders.items():
        names = notes.get(id(holder))
        if names is not None:
            try:
                found[key] = (weakref.ref(holder), frozenset(names))
            except TypeError:  # an object that cannot be weakly referenced: watched whole
                continue
    return Reads(MappingProxyType(found))
