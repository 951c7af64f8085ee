"""Whether a call wrote into the containers it was given: a key added to or taken from a dict, an
item appended to or replaced in a list, an attribute set on a dataclass or another object.

A graph returns values; it cannot replay such a write, and a served call would leave the
caller's batch without the ``logits`` the eager call put there. Like an in-place write to a
tensor, it makes the call's key serve eagerly. Told on the capturing call only, by identity:
what each container argument held before the eager run against what it holds after.

Two writes are not refused. A dict, ``UserDict`` or list the call returns is the one it was
given, updated (sentence-transformers' ``forward(features)`` adds its embeddings to ``features``
and returns it): a served call writes the graph's values into the caller's and returns that very
object wherever eager's output held it (``writeback``). Not a HuggingFace ``ModelOutput``,
which refuses to be refilled. A memo an object fills when read (a ``functools.cached_property``,
a new private attribute) is not a write: served calls skip filling it, and the next read fills it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict, UserDict, defaultdict
from collections.abc import Mapping, MutableMapping, MutableSequence, MutableSet
from typing import Any, Callable, Iterator

import optree
import torch

from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees

_DEPTH = 8  # a batch of batches of lists is looked into; what lies deeper is not
_MOST = 10_000  # nor more containers than this in one call (a dataset passed whole)


class Held:
    """What the containers among a call's arguments held, by identity, before the call."""

    def __init__(self, args: tuple, kwargs: dict, name_of: Callable[[int], str]) -> None:
        roots = [(name_of(i), a) for i, a in enumerate(args)] + list(kwargs.items())
        self._call = (args, kwargs)
        self._held = [(path, c, _snapshot(c)) for path, c in _containers(roots) if _writable(c)]

    def written(self, out: Any) -> list[str]:
        """The containers whose contents changed since, named by their path in the call; not
        those the call returned (``out``), which a served call writes (``writeback``)."""
        trees.adopt(out)  # a dataclass returned is a node, as the capture will flatten it
        returned = _replayed(self._call, out)
        return [path for path, c, before in self._held
                if id(c) not in returned and not _unchanged(c, before, _snapshot(c))]


def writeback(call: tuple, eager_out: Any, before: dict[tuple, Any] | None = None
              ) -> Callable[[Any, tuple, dict], Any] | None:
    """How a served call updates the mappings and lists eager returned that the call was given:
    ``finish(out, args, kwargs)`` writes the graph's (in ``out``) into the caller's, in place,
    and returns ``out`` holding those very objects wherever eager's held them. A mapping's
    entries the target left as they were (``before``: the call's leaves by path, before the
    eager run) keep the caller's tensor, as eager's do, not the graph's copy. ``None`` when
    eager returned none."""
    replayed = _replayed(call, eager_out)
    if not replayed:
        return None
    # The deepest first: an outer container then takes the inner one, already written, as it holds it.
    pairs = sorted(((source, paths, _left(paths[0](eager_out), source.path, before or {}))
                    for source, paths in replayed.values()), key=lambda pair: -max(map(len, pair[1])))

    def finish(out: Any, args: tuple, kwargs: dict) -> Any:
        for source, paths, left in pairs:
            mine, served = source((args, kwargs)), paths[0](out)
            if isinstance(mine, list):
                mine[:] = served
            else:
                kept = {key: mine[key] for key in left if key in mine}
                mine.clear()
                mine.update(served)
                mine.update(kept)  # (in place: the order stays the served one)
            for path in paths:
                out = trees.put(out, tuple(path), mine)
        return out

    return finish


def _left(container: Any, at: tuple, before: dict[tuple, Any]) -> tuple:
    """The keys of a mapping the target returned (``at``: its path in the call) that still hold
    the tensor they held before the call."""
    if not isinstance(container, Mapping):
        return ()
    return tuple(key for key, value in container.items()
                 if isinstance(value, torch.Tensor) and before.get((*at, key)) is value)


def _replayable(container: Any) -> bool:
    """A container ``writeback`` can refill: a list, a plain dict (and ``OrderedDict``,
    ``defaultdict``), a ``UserDict`` (a tokenizer's ``BatchEncoding``). Not a HuggingFace
    ``ModelOutput``, which refuses ``update`` and ``del``: a write into one is a mutation."""
    return type(container) in (list, dict, OrderedDict, defaultdict) or isinstance(container, UserDict)


def _replayed(call: tuple, out: Any) -> dict[int, tuple[Any, list[Any]]]:
    """The containers ``out`` holds that ``call`` was given and ``writeback`` can refill, by id:
    where each is in the call, and every place it is in the output (pytree accessors: the paths
    a served call's trees share)."""
    given = {id(c) for _, c in _containers([("", call)]) if _replayable(c)}
    shared = given & {id(c) for _, c in _containers([("", out)]) if _replayable(c)}
    replayed = {}
    for i in shared:
        sources, paths = _accessors(call, i), [p for p in _accessors(out, i) if trees.puttable(out, p)]
        if sources and paths:
            replayed[i] = (sources[0], paths)
    return replayed


def _accessors(tree: Any, wanted: int) -> list[Any]:
    """The accessors of every place ``tree`` holds the container whose id is ``wanted``."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=lambda node: id(node) == wanted, none_is_leaf=True, namespace=trees.NAMESPACE)
    return [accessor for accessor, leaf in zip(accessors, leaves) if id(leaf) == wanted]


def _containers(roots: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each container reachable from ``roots`` (once), with its path."""
    seen: set[int] = set()
    todo = [(path, value, 0) for path, value in reversed(roots)]
    while todo and len(seen) < _MOST:
        path, value, depth = todo.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, torch.nn.Module)) or kvcache.is_cache(value):
            continue
        children = _children(value)
        if children is None:
            continue
        seen.add(id(value))
        yield path, value
        if depth < _DEPTH:
            todo += [(f"{path}[{key!r}]", child, depth + 1) for key, child in reversed(children)]


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    """``value``'s items as (key, item), or ``None`` where it is not a container."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (list, tuple, MutableSequence, MutableSet)):
        return list(enumerate(value))
    if _plain_object(value):
        return list(vars(value).items())
    return None


def _writable(value: Any) -> bool:
    if isinstance(value, (MutableMapping, MutableSequence, MutableSet)):
        return True
    params = getattr(type(value), "__dataclass_params__", None)
    return (params is not None and not params.frozen) if dataclasses.is_dataclass(value) else _plain_object(value)


def _plain_object(value: Any) -> bool:
    """An instance of a user's class holding attributes (not a function, class or module)."""
    return hasattr(value, "__dict__") and not callable(value) and type(value).__module__ not in ("builtins", "types")


def _snapshot(container: Any) -> dict | list:
    """What ``container`` holds: its items by key (a mapping's, an object's attributes) or in order."""
    if isinstance(container, Mapping):
        return dict(container.items())
    if isinstance(container, (MutableSequence, MutableSet)):  # a set's order holds while it does
        return list(container)
    return dict(vars(container)) if hasattr(container, "__dict__") else {}


def _unchanged(container: Any, before: dict | list, now: dict | list) -> bool:
    if isinstance(before, list) or isinstance(now, list):
        return len(now) == len(before) and all(a is b for a, b in zip(now, before))
    if any(key not in now or now[key] is not value for key, value in before.items()):
        return False  # an entry replaced or taken away (in a mapping, order is not a write)
    added = [key for key in now if key not in before]
    if isinstance(container, Mapping):
        return not added
    return all(_memo(type(container), key) for key in added)


def _memo(cls: type, name: Any) -> bool:
    """Whether an attribute an object gained is a memo its reads fill: a private name, or a
    ``functools.cached_property`` of its class."""
    return isinstance(name, str) and (name.startswith("_") or isinstance(getattr(cls, name, None),
                                                                          functools.cached_property))
