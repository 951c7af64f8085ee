"""How a compiled function is copied, pickled and bound: ``copy.deepcopy`` and pickle give a fresh
function (nothing captured) over a copy of the target with the same options, and on a method in
a class body it binds like a method, one compiled function per instance."""

from __future__ import annotations

import copy
import types
from typing import Any, Callable


class Copies:
    """The copy, pickle and descriptor protocols of ``CompiledFunction``."""

    __wrapped__: Any
    __name__: str
    _options: dict[str, Any]  # the keywords it was made with

    def __set_name__(self, owner: type, name: str) -> None:
        self._attribute = name  # a method in a class body: where __get__ keeps each instance's own

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@cr.compile`` on a method in a class body binds like a method (as ``@torch.compile``
        does): each instance gets its own compiled function over its bound method, kept in the
        instance's ``__dict__`` under the method's name, so the instance owns it and the two go
        together (the cycle through the bound method is the garbage collector's to free)."""
        if instance is None or not isinstance(self.__wrapped__, types.FunctionType):
            return self
        bound = type(self)(self.__wrapped__.__get__(instance, owner), **self._options)
        try:
            vars(instance)[getattr(self, "_attribute", self.__name__)] = bound
        except TypeError:  # no instance __dict__ (__slots__): a compiled function per access
            pass
        return bound

    def __deepcopy__(self, memo: dict) -> Any:
        """A fresh function (nothing captured) over a deep copy of the target, with the same
        options: a copied model (an EMA or teacher copy) captures its own weights."""
        return type(self)(copy.deepcopy(self.__wrapped__, memo), **self._options)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the target and the options; unpickled fresh, nothing captured (graphs
        ship with ``take_graph()``)."""
        return _rebuilt, (type(self), self.__wrapped__, self._options)


def _rebuilt(cls: type, target: Callable[..., Any], options: dict[str, Any]) -> Any:
    return cls(target, **options)
