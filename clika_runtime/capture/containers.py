"""Whether a call wrote into the containers it was given: a key added to or taken from a dict, an
item appended to or replaced in a list, an attribute set on a dataclass or another object.

A graph returns values; it cannot replay such a write, and a served call would leave the
caller's batch without the ``logits`` the eager call put there. Like an in-place write to a
tensor, it makes the call's key serve eagerly. Told on the capturing call only, by identity:
what each container argument held before the eager run against what it holds after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, MutableSequence, MutableSet
from typing import Any, Callable, Iterator

import torch

from clika_runtime.trees import kvcache

_DEPTH = 4  # a batch of batches of lists is looked into; what lies deeper is not
_MOST = 10_000  # nor more containers than this in one call (a dataset passed whole)


class Held:
    """What the containers among a call's arguments held, by identity, before the call."""

    def __init__(self, args: tuple, kwargs: dict, name_of: Callable[[int], str]) -> None:
        roots = [(name_of(i), a) for i, a in enumerate(args)] + list(kwargs.items())
        self._held = list(_contents(roots))

    def written(self) -> list[str]:
        """The containers whose contents changed since, named by their path in the call."""
        return [path for path, container, before in self._held if not _same(_snapshot(container), before)]


def _contents(roots: list[tuple[str, Any]]) -> Iterator[tuple[str, Any, tuple]]:
    seen: set[int] = set()
    todo = [(path, value, 0) for path, value in roots]
    while todo and len(seen) < _MOST:
        path, value, depth = todo.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, torch.nn.Module)) or kvcache.is_cache(value):
            continue
        children = _children(value)
        if children is None:
            continue
        seen.add(id(value))
        if _writable(value):
            yield path, value, _snapshot(value)
        if depth < _DEPTH:
            todo += [(f"{path}[{key!r}]", child, depth + 1) for key, child in children]


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    """``value``'s items as (key, item), or ``None`` where it is not a container."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (list, tuple, MutableSequence)):
        return list(enumerate(value))
    if isinstance(value, MutableSet):
        return [(i, v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    if _plain_object(value):
        return list(vars(value).items())
    return None


def _writable(value: Any) -> bool:
    return isinstance(value, (MutableMapping, MutableSequence, MutableSet)) or _has_attributes(value)


def _has_attributes(value: Any) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return (params is not None and not params.frozen) or _plain_object(value)


def _plain_object(value: Any) -> bool:
    """An instance of a user's class holding attributes (not a function, class or module)."""
    return hasattr(value, "__dict__") and not callable(value) and type(value).__module__ not in ("builtins", "types")


def _snapshot(container: Any) -> tuple:
    if isinstance(container, Mapping):
        items = list(container.items())
    elif isinstance(container, MutableSet):
        items = [(v, v) for v in container]
    elif isinstance(container, (list, MutableSequence)):
        items = list(enumerate(container))
    else:
        items = list(vars(container).items()) if hasattr(container, "__dict__") else []
    return tuple(items)


def _same(now: tuple, before: tuple) -> bool:
    return len(now) == len(before) and all(k is j and v is w for (k, v), (j, w) in zip(now, before))
