"""How a compiled function stands in for its target in Python: ``copy.deepcopy`` and pickle give a
fresh function (nothing captured) over a copy of the target with the same options, on a method in
a class body it binds like a method, one compiled function per instance, and ``inspect.signature``
gives the target's."""

from __future__ import annotations

import copy
import functools
import inspect
import types
from typing import Any, Callable


class Copies:
    """The copy, pickle, descriptor and signature protocols of ``CompiledFunction``."""

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

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        """The target's signature, worked out once: transformers' ``generate`` asks for the
        forward's on every step (``inspect.signature`` unwraps and rebuilds it each time, about
        20 us), and the target's cannot change."""
        try:
            return inspect.signature(self.__wrapped__)
        except (TypeError, ValueError) as e:  # no signature (a builtin): inspect's own fallbacks
            raise AttributeError("__signature__") from e

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
