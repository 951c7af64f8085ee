"""One canonical form per call, for the cache key only: ``f(x, y)`` and ``f(x, y=y)`` must not
cost two captures, nor ``f(x, a=a, b=b)`` and ``f(x, b=b, a=a)`` when ``a`` and ``b`` are parameters.

The target itself always receives the call exactly as the user made it: decorated forwards (such
as HuggingFace's) reject re-slotted keywords, and a ``**kwargs`` target sees its keywords in the
order given. So keywords that land in ``**kwargs`` keep their order in the canonical form too
(their order is part of what the target receives).

The target's signature is read once; each call form (positional count, keyword names) is planned
once and cached, so canonicalising costs a dict lookup, never an ``inspect.signature`` bind.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from clika_runtime.base.slots import KEYWORD, MISSING, slotted

_EMPTY = inspect.Parameter.empty

Plan = tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]  # (positional slots to add, keywords left)


class CallForms:
    """Moves keyword arguments that name positional parameters into their positional slots."""

    def __init__(self, target: Callable[..., Any]) -> None:
        self.positional: list[str] = []
        self.keyword_only: list[str] = []
        self.defaults: dict[str, Any] = {}
        self.var_positional: str | None = None
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):  # builtins and C callables: calls are taken as given
            parameters = []
        for p in parameters:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.positional.append(p.name)
                if p.default is not _EMPTY:
                    self.defaults[p.name] = p.default
            elif p.kind is p.VAR_POSITIONAL:
                self.var_positional = p.name
            elif p.kind is p.KEYWORD_ONLY:
                self.keyword_only.append(p.name)
        self._plans: dict[tuple[int, tuple[str, ...]], Plan | None] = {}

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The canonical ``(args, kwargs)`` of a call, made of the call's own objects (and the
        defaults of positional slots the call skipped)."""
        if not kwargs:
            return args, kwargs
        form = (len(args), tuple(kwargs))
        try:
            plan = self._plans[form]
        except KeyError:
            plan = self._plans[form] = self._plan(*form)
        if plan is None:
            return args, kwargs
        slots, rest = plan
        extra = tuple(kwargs[name] if source is KEYWORD else source for name, source in slots)
        return args + extra, {k: kwargs[k] for k in rest}

    def _plan(self, nargs: int, names: tuple[str, ...]) -> Plan | None:
        movable = [n for n in names if n in self.positional[nargs:]]
        slots: tuple[tuple[str, Any], ...] = ()
        if movable:
            planned = slotted(self.positional, nargs, names, self._default)
            if planned is None:  # a required parameter is missing (the target raises), or a tensor default
                return None
            slots = planned[0]
        # Keyword-only parameters in declaration order, then what lands in **kwargs as given.
        declared = [n for n in self.keyword_only if n in names]
        rest = declared + [n for n in names if n not in movable and n not in self.keyword_only]
        if not slots and tuple(rest) == names:
            return None
        return tuple(slots), tuple(rest)

    def _default(self, index: int, name: str | None) -> Any:
        """A skipped slot's value: its parameter's default (a tensor default would become a graph
        input the user never passes: such forms stay as given)."""
        default = self.defaults.get(name, MISSING) if name is not None else MISSING
        return MISSING if default is MISSING or _is_tensor(default) else default

    def argument_name(self, index: int) -> str:
        """The parameter name of positional argument ``index`` (``args_2`` past the named ones)."""
        if index < len(self.positional):
            return self.positional[index]
        return f"{self.var_positional or 'args'}_{index - len(self.positional)}"


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "shape")


class _Tag:
    """Stands for one leaf of the original call while its canonical form is planned."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def original_slots(forms: CallForms, args: tuple, kwargs: dict) -> tuple[Any, list[int | None]]:
    """How to rebuild the call as the user made it from its canonical leaves: the original
    structure, and for each canonical leaf the original leaf it is (``None``: a default the
    canonical form filled in for a skipped positional slot)."""
    from clika_runtime.trees import pytrees as trees

    leaves, structure = trees.flatten((args, kwargs))
    tagged = structure.unflatten([_Tag(i) for i in range(len(leaves))])
    canonical = trees.flatten(forms(*tagged))[0]
    return structure, [leaf.index if isinstance(leaf, _Tag) else None for leaf in canonical]
