"""Which attribute names a capture's eager run can have read, so that the per-call watch leaves
out the others: a request counter, the last latency, a stats namespace the caller updates
between calls are no change of state.

While the eager run lasts, this thread's trace function (``sys.settrace``, chained to one already
set: a debugger, coverage) notes each code object that starts. The names the run can have read
are those its code names (``co_names``: every ``x.attr`` loaded) and its string constants
(``getattr(self, "bias", 0.0)``, ``vars(self)["gain"]``, ``object.__getattribute__(self, "k")``),
closed over the methods and properties of the watched objects' classes those names name (a
branch under ``torch.compiler.is_compiling()`` calling a method eager never called). A name in
code of a branch not taken counts too: more is watched, never less. The objects are not touched.

A value that no code of the run names cannot have decided what the call computed (what it reads
decides every branch it takes: the argument torch.compile's guards rest on), but for reads whose
name is computed (``getattr(self, name)``): where the user's own code names ``vars`` or
``__dict__``, nothing is left out. An object whose class translates names in a
``__getattribute__`` of its own (transformers' configs) is watched whole.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

from clika_runtime.base.libraries import library_package
from clika_runtime.state.compare import Part, subset

_WHOLE = frozenset({"vars", "__dict__"})  # the user's code reading every attribute at once
_CLOSED_OVER = 4  # rounds of methods found through names (a method calling a method ...)


@dataclass(frozen=True)
class Reads:
    """The attribute names the captures' runs can have read (``None``: any: nothing is left out)."""

    names: frozenset[str] | None = frozenset()

    def __or__(self, other: "Reads") -> "Reads":
        if self.names is None or other.names is None:
            return Reads(None)
        return Reads(self.names | other.names)


@contextmanager
def noted() -> Iterator[dict[types.CodeType, str]]:
    """The code objects that start in this thread while the block runs, with their module's name."""
    codes: dict[types.CodeType, str] = {}
    previous = sys.gettrace()

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
        codes.setdefault(frame.f_code, frame.f_globals.get("__name__") or "")
        return previous(frame, event, arg) if previous is not None else None

    sys.settrace(tracer)
    try:
        yield codes
    finally:
        sys.settrace(previous)


def read(codes: Mapping[types.CodeType, str], holders: Mapping[int, Any]) -> Reads:
    """The names the code in ``codes`` can read, closed over the watched objects' (``holders``)
    methods and properties those names name."""
    names: set[str] = set()
    for code, module in codes.items():
        named = _named(code)
        if named & _WHOLE and not library_package(module.split(".")[0]):
            return Reads(None)
        names |= named
    classes = {type(holder) for holder in holders.values()}
    for _ in range(_CLOSED_OVER):
        more = {name for cls in classes for code in _methods(cls, names) for name in _named(code)} - names
        if not more:
            break
        names |= more
    return Reads(frozenset(names))


def _named(code: types.CodeType) -> set[str]:
    return set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)} | {
        name for c in code.co_consts if isinstance(c, types.CodeType) for name in _named(c)}


def _methods(cls: type, names: set[str]) -> Iterator[types.CodeType]:
    """The code of ``cls``'s functions, properties and cached properties named in ``names``."""
    for owner in cls.__mro__:
        for name, value in vars(owner).items():
            if name not in names:
                continue
            for fn in (value, getattr(value, "fget", None), getattr(value, "func", None), getattr(value, "__func__", None)):
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    yield code


def narrowed(part: Part, reads: Reads, holder: Any) -> Part:
    """``part`` (the attributes of ``holder``) watching the names the captures can have read,
    private ones included, and not the others; all of them where any may have been read; the
    public ones of an object whose class translates names (its private ones stay out)."""
    if part.size is None or holder is None:  # not an object's attributes
        return part
    if _translates(type(holder)):
        return _kept(part, [k for k in part.keys if k not in part.hidden], None) if part.hidden else part
    if reads.names is None:
        return replace(part, hidden=frozenset())
    return _kept(part, [k for k in part.keys if k in reads.names], reads.names)


def _translates(cls: type) -> bool:
    """Whether ``cls`` (or a base) has a ``__getattribute__`` of its own in Python: a name asked
    may be read under another (transformers' ``config.hidden_size`` reads ``n_embd``)."""
    return any(isinstance(vars(owner).get("__getattribute__"), types.FunctionType) for owner in cls.__mro__)


def _kept(part: Part, keys: list[str], only: frozenset[str] | None) -> Part:
    return replace(subset(part, keys), only=only)
