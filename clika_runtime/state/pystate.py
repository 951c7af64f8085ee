"""The Python state a graph baked besides tensors, and the per-call check that it is unchanged.

A trace reads more than tensors: a module's plain attributes (``self.scale``, ``self.config.
output_hidden_states``), which submodules it holds, its forward hooks and a patched ``forward``;
a function's closure cells, the globals its code names, its defaults. The graph keeps what they
were at capture, so after ``model.config.output_hidden_states = True``, ``model.act = nn.Tanh()``
or ``SCALE = 5.0`` the graph would answer for the old state. A ``Snapshot`` records that state
when a capture is made; ``fresh()`` compares it on every served call; ``changed()`` names what
moved, for the re-capture's reason.

The per-call check is one C-level getter per watched dictionary whose result is compared with
the snapshot (identity first, so an unchanged object is never compared by value), dictionaries'
lengths (an added attribute), and torch's count of hook handles ever made (a hook added anywhere).
Other modules' children are compared when torch's registration counter moves (``weights.py``
watches it) and hooks when the handle count does (then only they are compared when nothing
else moved). Containers are snapshotted by a copy three levels deep when they hold up to
``_COPIED`` items in all; past that, by identity. Values compare by ``==``: ``2`` re-assigned as
``2.0`` is no change.

Watched: every module of the owner (its public attributes, ``_modules``, forward hooks; the
children of ``Sequential`` / ``ModuleList`` / ``ModuleDict`` on every call), the globals its
``forward`` names, objects those attributes hold that carry attributes of their own (configs,
private attributes included; two levels), torch's global forward hooks and default dtype; for a
function, its closure cells, defaults, code and the globals its code loads, a partial's
arguments, a bound or callable object's attributes; and the modules found among all those, as
trees (``modules_reached``: ``weights.py`` watches their tensors). Not watched: modules' private
attributes, class attributes, imported modules' attributes, globals of the functions the target
calls, loggers and threading objects, grad mode (graphs serve inference; see README). Autocast
is not state but a mode of the call (``autocast_off``): under it calls run eagerly.
"""

from __future__ import annotations

import dis
import functools
import logging
import operator
import threading
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

_COPIED = 64  # containers up to this many items are compared by value, larger ones by identity
_DEPTH = 2  # levels of attribute-carrying objects watched below a module
# The private entries of a module's __dict__ that change what a call computes (a hook's flags,
# "with kwargs" and "always called", are only ever set beside its entry in these).
_MODULE_PRIVATE = ("_modules", "_forward_hooks", "_forward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_call = getattr(operator, "call", None) or (lambda f, x: f(x))  # operator.call: Python 3.11+
_contents = operator.attrgetter("cell_contents")

_CODE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
         functools.partial, torch.nn.Module, torch.Tensor)
_CONTAINERS = (dict, list, tuple, set, frozenset, str, bytes)
# Loggers and threads' synchronisation objects: their state is not a value a graph is traced with.
_INERT = (logging.Logger, logging.LoggerAdapter, threading.Event, threading.Condition, threading.Semaphore,
          threading.Barrier, threading.Thread)
_CONTAINER_MODULES = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass(frozen=True)
class Part:
    """One watched container: what it is called, how its watched values are read, their snapshot."""

    name: str  # "encoder.layer.0", "config", "the closure of f"
    container: Any
    keys: tuple[str, ...]  # the watched entries, in the order ``read`` returns them
    read: Callable[[Any], Any] | None  # container -> the watched values (one key: its value)
    values: tuple
    size: int | None  # len(container) at capture (None: not compared)
    known: frozenset[str] = frozenset()  # every key the container had at capture (dictionaries)
    variables: bool = False  # entries are a function's variables ("global 'SCALE'"), not attributes
    per_call: bool = True  # False: compared only when a counter says it may have moved (submodules, hooks)
    trigger: bool = False  # only says that the others must be compared (a count of hooks): never a change


class Snapshot:
    """The state of a target at capture. Immutable; ``fresh()`` is the hot path's check."""

    def __init__(self, parts: list[Part], root: torch.nn.Module | None = None) -> None:
        self.parts = tuple(parts)
        self.root = root
        # Captures are keyed by the root's training flag: ``model.train()`` / ``.eval()`` switching
        # every module at once is not a change of state, one submodule switched alone is.
        self.uniform = root is not None and _uniform(root)
        self._own = {id(vars(m)) for m in root.modules()} if root is not None else set()  # the key's modules
        self.fresh: Callable[[], bool] = self.check(_always, modes=False) if self.parts else _always

    def check(self, weights: Callable[[], bool], modes: bool = True) -> Callable[[], bool]:
        """The served call's whole check as one closure: ``weights()`` first, then this state, then
        (``modes``) that no autocast region is active."""
        return _fresh_check(self.parts, weights, _any_autocast if modes else _never)

    @classmethod
    def of(cls, fn: Any, owner: torch.nn.Module | None, skip: frozenset[tuple[str, str]] = frozenset()) -> "Snapshot":
        """The state ``fn`` (whose weights ``owner`` holds, if a module) reads now, but the
        entries in ``skip`` (``moved()`` pairs: what the target writes itself)."""
        parts, _ = cls._parts(fn, owner)
        kept = [_without(part, skip) for part in parts] if skip else parts
        return cls([part for part in kept if part is not None], owner)

    @staticmethod
    def _parts(fn: Any, owner: torch.nn.Module | None) -> tuple[list[Part], _Walk]:
        walk = _Walk()
        parts: list[Part] = []
        if owner is not None:
            parts += _module_tree(owner, "", walk)
            forward = _forward(fn, owner)
            parts += _globals(forward, walk) if forward is not None else []
        else:
            for layer in _unwrapped(fn):
                parts += _callable(layer, walk)
        return parts + _global_hooks() + [_default_dtype()], walk

    def changed(self) -> list[str]:
        """What differs from the snapshot, in words (empty: nothing a call reads)."""
        switched = self.uniform and _uniform(self.root)  # a whole-model train()/eval(): the key has it
        words = [_word(part, key) for part in self.parts for key in _differences(part)
                 if not (switched and key == "training" and id(part.container) in self._own)]
        return list(dict.fromkeys(words))  # a container's children are watched twice: said once

    def retriggered(self) -> "Snapshot | None":
        """After torch's count of hook handles moved (a hook made anywhere in the process): the
        same snapshot at the new count when no watched module's hooks or children moved and the
        rest is as it was; ``None`` when something else may have moved (compare everything)."""
        if any(_differences(p) for p in self.parts if not p.per_call and not p.trigger):
            return None
        again = Snapshot([_reread(p) if p.trigger else p for p in self.parts], self.root)
        return again if again.fresh() else None

    def refreshed(self, skip: frozenset[tuple[str, str]] = frozenset()) -> "Snapshot":
        """The same watch over the values as they are now, but the entries in ``skip``: after
        ``changed()`` found nothing a call reads (a hook made and removed elsewhere, an equal
        value re-assigned), or after a capture's eager run wrote ``skip``; without walking the
        target again."""
        parts = [_reread(part) for part in self.parts]
        kept = [_without(part, skip) for part in parts] if skip else parts
        return Snapshot([part for part in kept if part is not None], self.root)

    def moved(self) -> frozenset[tuple[str, str]]:
        """The entries that differ from the snapshot, as (part, key) pairs: taken around a call of
        the target, what the target writes itself (``self.last_batch = ...``). An entry that was
        ``None`` is not one: a default the first call fills in (``config.problem_type``) stays
        watched, for the user's own changes (a target that writes it on every call is found
        writing it at its next eager call, which re-captures once)."""
        return frozenset((part.name, key) for part in self.parts for key in _differences(part)
                         if not (key in part.keys and part.values[part.keys.index(key)] is None))


def modules_reached(fn: Any, owner: torch.nn.Module | None) -> list[tuple[str, torch.nn.Module]]:
    """The modules a target reads outside its owner's registered tree, by where it finds them
    (``model`` in a closure, ``the callable object.model``, ``layers.0`` in a plain list)."""
    return Snapshot._parts(fn, owner)[1].reached


def _autocast_check() -> Callable[[], bool]:
    """One C call; without it (a torch that renamed it), the public check per device type."""
    private = getattr(torch._C, "_is_any_autocast_enabled", None)
    return private or (lambda: any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))


_any_autocast = _autocast_check()


def autocast_off() -> bool:
    """No ``torch.autocast`` region is active (graphs are captured at the inputs' own dtypes)."""
    return not _any_autocast()


def _always() -> bool:
    return True


def _never() -> bool:
    return False


def _uniform(root: torch.nn.Module) -> bool:
    return len({m.training for m in root.modules()}) == 1


def _fresh_check(parts: tuple[Part, ...], weights: Callable[[], bool], autocast: Callable[[], bool]) -> Callable[[], bool]:
    """One closure over plain data: the weights, torch's hook count and default dtype (read
    inline: the commonest checks, the cheapest way), the lengths, then the watched values, each
    list compared whole."""
    from torch.utils.hooks import RemovableHandle

    sized = tuple(p.container for p in parts if p.size is not None)
    sizes = [p.size for p in parts if p.size is not None]
    checked = [p for p in parts if p.read is not None and p.per_call]
    readers = tuple(p.read for p in checked)
    read_from = tuple(p.container for p in checked)
    values = [p.values[0] if len(p.keys) == 1 else p.values for p in checked]  # a getter of one key: its value
    inline = {id(p.container): p.values[0] for p in parts if p.container is RemovableHandle or p.container is torch}
    handles, made = RemovableHandle, inline.get(id(RemovableHandle), RemovableHandle.next_id)  # as at the snapshot
    default_dtype, dtype = torch.get_default_dtype, inline.get(id(torch), torch.get_default_dtype())

    def fresh() -> bool:
        try:
            return (weights() and handles.next_id == made and default_dtype() is dtype
                    and list(map(len, sized)) == sizes and list(map(_call, readers, read_from)) == values
                    and not autocast())
        except Exception:  # a value whose == cannot answer (an array): the miss path compares carefully
            return False

    return fresh


# ------------------------------------------------------------------------------------- building


@dataclass
class _Walk:
    """What building a snapshot has met: objects already watched, and the modules the target
    reaches outside its owner's registered tree (their tensors are baked as constants)."""

    seen: set[int] = field(default_factory=set)
    reached: list[tuple[str, torch.nn.Module]] = field(default_factory=list)


def _held(value: Any, name: str, walk: _Walk, depth: int = _DEPTH) -> list[Part]:
    """What a value the target reads holds that may change: a module's tree, an object's
    attributes, and those of the modules and objects in a small container. A value that cannot
    be walked (its attributes raise) is watched by identity only, where its holder is."""
    try:
        if isinstance(value, torch.nn.Module):
            if id(value) in walk.seen:
                return []
            walk.reached.append((name, value))
            return _module_tree(value, name, walk)
        if type(value) in (list, tuple, dict) and len(value) <= _COPIED:
            if depth == 0 or id(value) in walk.seen:  # bounded, and a container holding itself ends
                return []
            walk.seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            return [part for key, item in items for part in _held(item, f"{name}.{key}", walk, depth - 1)]
        return _objects(value, name, walk, depth) if _carries_attributes(value) else []
    except Exception:  # a property that raises, a recursion too deep: not watched
        return []


def _module_tree(root: torch.nn.Module, prefix: str, walk: _Walk) -> list[Part]:
    parts = []
    for name, module in root.named_modules(prefix=prefix):
        if id(module) in walk.seen:
            continue
        walk.seen.add(id(module))
        state = vars(module)
        keys = [k for k in state if not k.startswith("_")]
        where = name or "the module"
        parts.append(_dict_part(where, state, keys, sized=True))
        parts.append(replace(_dict_part(where, state, [k for k in _MODULE_PRIVATE if k in state], sized=False,
                                        whole=True), per_call=False))
        parts += [_sized(where, state[k]) for k in _MODULE_PRIVATE[1:] if state.get(k)]  # a hook removed
        if isinstance(module, _CONTAINER_MODULES):  # their forward iterates their children: a deletion shows
            parts.append(_dict_part(where, state, ["_modules"], sized=False, whole=True))
        for key in keys:
            parts += _held(state[key], f"{where}.{key}" if name else key, walk)
    return parts


def _objects(value: Any, name: str, walk: _Walk, depth: int) -> list[Part]:
    """An attribute-carrying object (a config) and those it holds, ``depth`` levels down; its
    private attributes too (transformers keeps ``_attn_implementation`` there)."""
    if depth == 0 or id(value) in walk.seen:
        return []
    walk.seen.add(id(value))
    state = vars(value)
    keys = [k for k in state if not k.startswith("__")]
    if len(keys) > 4 * _COPIED:  # not a config: a big object held by reference, watched by identity
        return []
    parts = [_dict_part(name, state, keys, sized=True)]
    for key in keys:
        parts += _held(state[key], f"{name}.{key}", walk, depth - 1)
    return parts


def _unwrapped(fn: Any) -> Iterator[Any]:
    """``fn`` and the callables it wraps (``functools.wraps``, a wrapper object's ``__wrapped__``,
    a ``functools.partial``'s function)."""
    met: set[int] = set()
    while fn is not None and id(fn) not in met:
        met.add(id(fn))
        yield fn
        fn = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)


def _callable(fn: Any, walk: _Walk) -> list[Part]:
    """What one layer of a target that is not a module reads: a function's variables, a
    partial's arguments, a bound method's object, a callable object's attributes (a wrapper's
    are its own bookkeeping), a module called through a partial."""
    if isinstance(fn, torch.nn.Module):
        return _held(fn, "module", walk)
    if isinstance(fn, functools.partial):
        parts = [Part("the partial's", fn, ("args", "keywords"), operator.attrgetter("args", "keywords"),
                      (_frozen(fn.args), _frozen(fn.keywords)), None, variables=True)]
        return parts + _held(fn.args, "argument", walk) + _held(fn.keywords, "keyword", walk)
    inner = getattr(fn, "__func__", fn)
    parts = _function(inner, walk) if isinstance(inner, types.FunctionType) else []
    if inner is not fn:
        held, name = getattr(fn, "__self__", None), "the bound object"
    else:
        held, name = (None if hasattr(fn, "__wrapped__") else fn), "the callable object"
    if held is not None and not isinstance(held, _CODE + _CONTAINERS) and isinstance(getattr(held, "__dict__", None), dict):
        parts += _objects(held, name, walk, _DEPTH)
    return parts


def _function(fn: types.FunctionType, walk: _Walk) -> list[Part]:
    parts = [Part(f"{fn.__qualname__}'s", fn, ("__defaults__", "__kwdefaults__", "__code__"),
                  operator.attrgetter("__defaults__", "__kwdefaults__", "__code__"),
                  (_frozen(fn.__defaults__), _frozen(fn.__kwdefaults__), fn.__code__), None, variables=True)]
    cells = tuple(c for c in fn.__closure__ or () if filled(c))
    names = dict(zip((id(c) for c in fn.__closure__ or ()), fn.__code__.co_freevars))
    if cells:
        parts.append(_cells_part(cells, tuple(names[id(c)] for c in cells)))
    for cell in cells:
        parts += _held(cell.cell_contents, names[id(cell)], walk)
    return parts + _globals(fn, walk)


def _cells_part(cells: tuple, names: tuple[str, ...]) -> Part:
    one = len(cells) == 1  # one cell is read alone: a getter of one key gives the value itself
    return Part("closed-over", cells[0] if one else cells, names, _contents if one else _cells,
                tuple(_frozen(c.cell_contents) for c in cells), None, variables=True)


def _globals(fn: types.FunctionType, walk: _Walk) -> list[Part]:
    """The globals ``fn``'s code names (modules aside: ``torch``, ``F``) and what they hold."""
    namespace = fn.__globals__
    read = sorted({k for k in global_names(fn.__code__) if k in namespace and not isinstance(namespace[k], types.ModuleType)})
    if not read:
        return []
    parts = [replace(_dict_part("global", namespace, read, sized=False), variables=True)]
    for name in read:
        parts += _held(namespace[name], name, walk)
    return parts


def _forward(fn: Any, owner: torch.nn.Module) -> types.FunctionType | None:
    """The code of a module target's own forward (a bound ``model.forward`` or the class's)."""
    code = getattr(fn, "__func__", None) if getattr(fn, "__self__", None) is owner else None
    code = code or getattr(type(owner), "forward", None)
    return code if isinstance(code, types.FunctionType) else None


def _global_hooks() -> list[Part]:
    """Hooks added anywhere (torch counts their handles), and torch's global forward hooks."""
    from torch.nn.modules import module
    from torch.utils.hooks import RemovableHandle

    made = Part("hooks", RemovableHandle, ("next_id",), operator.attrgetter("next_id"),
                (RemovableHandle.next_id,), None, per_call=False, trigger=True)  # read inline per call
    namespace = vars(module)
    hooks = [name for name in _GLOBAL_HOOKS if isinstance(namespace.get(name), dict)]
    global_hooks = replace(_dict_part("torch's", namespace, hooks, sized=False), variables=True, per_call=False)
    return [made, global_hooks] + [_sized("torch's", namespace[name]) for name in hooks if namespace[name]]


def _default_dtype() -> Part:
    """``torch.set_default_dtype``: what tensors made without a dtype are (``torch.ones(3)``)."""
    return Part("torch's", torch, ("default dtype",), _get_default_dtype, (torch.get_default_dtype(),), None,
                variables=True, per_call=False)  # read inline per call


def _get_default_dtype(_: Any) -> torch.dtype:
    return torch.get_default_dtype()


def _sized(name: str, hooks: dict) -> Part:
    """The length of a dictionary of hooks that has some: removing one makes no new handle."""
    return Part(name, hooks, (), None, (), len(hooks), trigger=True)


def _dict_part(name: str, state: dict, keys: list[str], *, sized: bool, whole: bool = False) -> Part:
    """``keys`` of ``state``; ``whole``: their values are dictionaries copied whatever their size
    (a module's children and hooks: a swap in a 100-layer list must show)."""
    values = tuple(dict(state[k]) if whole else _frozen(state[k]) for k in keys)
    if not keys:
        return Part(name, state, (), None, (), len(state) if sized else None, frozenset(state))
    return Part(name, state, tuple(keys), operator.itemgetter(*keys), values, len(state) if sized else None,
                frozenset(state))


def _cells(cells: tuple) -> tuple:
    return tuple(map(_contents, cells))


def global_names(code: types.CodeType) -> Iterator[str]:
    """The global names a code object (and the functions it defines) loads; not ``co_names``,
    which also holds attribute names (``self.out`` would watch a global ``out``)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from global_names(const)


def filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned after the function was made)
        return False
    return True


def _carries_attributes(value: Any) -> bool:
    """A plain object with attributes of its own (a config, a namespace), not code or a module."""
    return value is not None and not isinstance(value, _CODE + _CONTAINERS + _INERT) and not callable(value) \
        and isinstance(getattr(value, "__dict__", None), dict)


def _frozen(value: Any, depth: int = 3) -> Any:
    """What to keep of ``value``: a copy of a small container, ``depth`` levels down (it may
    change in place), when it holds at most ``_COPIED`` items in all (compared on every call);
    a tuple only when something in it was copied."""
    if depth == 0 or not isinstance(value, (dict, list, set, tuple)) or _items(value, depth) > _COPIED:
        return value
    return _copied(value, depth)


def _items(value: Any, depth: int) -> int:
    """How many items ``value`` holds, ``depth`` levels down (counting stops past ``_COPIED``)."""
    if depth == 0 or not isinstance(value, (dict, list, set, tuple)):
        return 0
    total = len(value)
    for item in value.values() if isinstance(value, dict) else value:
        if total > _COPIED:
            break
        total += _items(item, depth - 1)
    return total


def _copied(value: Any, depth: int) -> Any:
    if depth == 0 or not isinstance(value, (dict, list, set, tuple)):
        return value
    if isinstance(value, dict):
        return {k: _copied(v, depth - 1) for k, v in value.items()}
    copied = type(value)(_copied(v, depth - 1) for v in value) if type(value) in (list, set, tuple) else value
    return value if type(value) is tuple and all(a is b for a, b in zip(copied, value)) else copied


# ------------------------------------------------------------------------------------- comparing


def _differences(part: Part) -> list[str]:
    """The keys of ``part`` whose values differ, and public keys added since."""
    if part.trigger:
        return []
    try:
        now = part.read(part.container) if part.read is not None else ()
        now = (now,) if len(part.keys) == 1 else now  # a getter of one key gives the value itself
    except Exception:  # an entry deleted, a cell emptied
        return list(part.keys)
    found = [key for key, old, new in zip(part.keys, part.values, now) if not _same(old, new)]
    if part.size is not None and len(part.container) != part.size:
        found += [key for key in part.container if key not in part.known and not key.startswith("_")]
    return found


def _reread(part: Part) -> Part:
    """``part`` with its values, size and keys as they are now."""
    now = part.read(part.container) if part.read is not None else ()
    now = (now,) if len(part.keys) == 1 else tuple(now)
    whole = bool(part.keys) and all(k in _MODULE_PRIVATE for k in part.keys)
    container = part.container
    return replace(part, values=tuple(dict(v) if whole else _frozen(v) for v in now),
                   size=len(container) if part.size is not None else None,
                   known=frozenset(container) if isinstance(container, dict) else part.known)


def _without(part: Part, skip: frozenset[tuple[str, str]]) -> Part | None:
    """``part`` without the keys in ``skip``; a part that is not a dictionary is left out whole."""
    kept = [key for key in part.keys if (part.name, key) not in skip]
    if len(kept) == len(part.keys):
        return part
    if part.read in (_contents, _cells):  # a closure: its other cells stay watched
        cells = (part.container,) if len(part.keys) == 1 else part.container
        pairs = [(cell, key) for cell, key in zip(cells, part.keys) if key in kept]
        return _cells_part(tuple(c for c, _ in pairs), tuple(k for _, k in pairs)) if pairs else None
    if not isinstance(part.container, dict):
        return None
    fewer = _dict_part(part.name, part.container, kept, sized=part.size is not None,
                       whole=any(k in _MODULE_PRIVATE for k in kept))
    return replace(fewer, variables=part.variables, per_call=part.per_call)


def _word(part: Part, key: str) -> str:
    if part.variables:
        return f"{part.name} '{key.strip('_')}'"
    if key in _MODULE_PRIVATE:
        what = "submodules" if key == "_modules" else "forward hooks"
        return f"{what} of {part.name}" if part.name == "the module" else f"{what} of '{part.name}'"
    return f"'{key}'" if part.name == "the module" else f"'{part.name}.{key}'"


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    if isinstance(old, (dict, list, set, tuple, str, bytes, int, float, complex, bool)) and type(old) is type(new):
        try:
            return bool(old == new)
        except Exception:  # containers holding arrays or tensors: not comparable by value
            return False
    return isinstance(new, dict) and isinstance(old, dict) and _dicts_same(old, new)


def _dicts_same(old: dict, new: dict) -> bool:
    return old.keys() == new.keys() and all(_same(old[k], new[k]) for k in old)
