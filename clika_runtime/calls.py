"""One canonical form per call: ``f(x, y)`` and ``f(x, y=y)`` must not cost two captures, nor
``f(x, a=a, b=b)`` and ``f(x, b=b, a=a)``.

The target's signature is read once; each call form (positional count, keyword names) is planned
once and cached, so a call costs a dict lookup, never an ``inspect.signature`` bind.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

_EMPTY = inspect.Parameter.empty
_KW = object()  # plan entry: take this slot from the keyword arguments


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
        self._plans: dict[tuple[int, tuple[str, ...]], tuple[tuple[Any, ...], tuple[str, ...]] | None] = {}

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The canonical ``(args, kwargs)`` of a call."""
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
        extra = tuple(kwargs[name] if source is _KW else source for name, source in slots)
        return args + extra, {k: kwargs[k] for k in rest}

    def _plan(self, nargs: int, names: tuple[str, ...]) -> tuple[tuple[Any, ...], tuple[str, ...]] | None:
        movable = [n for n in names if n in self.positional[nargs:]]
        slots = []
        if movable:
            last = max(self.positional.index(n) for n in movable)
            for name in self.positional[nargs : last + 1]:
                if name in names:
                    slots.append((name, _KW))
                elif name in self.defaults:
                    slots.append((name, self.defaults[name]))
                else:  # a required parameter is missing: let the target raise its own error
                    return None
        # Remaining keywords in one order: keyword-only parameters as declared, then the rest sorted.
        rest = [n for n in names if n not in movable]
        rest.sort(key=lambda n: (0, self.keyword_only.index(n), "") if n in self.keyword_only else (1, 0, n))
        if not slots and tuple(rest) == names:
            return None
        return tuple(slots), tuple(rest)

    def argument_name(self, index: int) -> str:
        """The parameter name of positional argument ``index`` (``args_2`` past the named ones)."""
        if index < len(self.positional):
            return self.positional[index]
        return f"{self.var_positional or 'args'}_{index - len(self.positional)}"
