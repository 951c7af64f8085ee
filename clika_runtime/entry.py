"""``compile``: the entry point, usable as a call and as a decorator (with or without arguments)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar, overload

from clika_runtime.function.compiled import CompiledFunction

F = TypeVar("F", bound=Callable[..., Any])


@overload
def compile(target: F, /, **options: Any) -> CompiledFunction: ...


@overload
def compile(target: None = None, /, **options: Any) -> Callable[[F], CompiledFunction]: ...


def compile(target: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Capture ``target`` into an ONNX graph on its first call and serve later calls from it.

    ``cr.compile(model)``, ``@cr.compile`` and ``@cr.compile(place="cpu", ...)`` all work; the
    keywords are those of :class:`CompiledFunction`. ``place`` is checked here: a provider
    onnxruntime cannot give raises ``PlaceError`` now, not at the first call.
    """
    if target is None:
        return lambda fn: CompiledFunction(fn, **options)
    return CompiledFunction(target, **options)
