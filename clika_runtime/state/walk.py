"""What a target reads besides tensors, walked once per snapshot into ``Part``s.

Watched: where the owner's forward is found (its class, and each fx ``GraphModule``'s: a forward
rewritten there by ``recompile()`` or an assignment), every module of the owner (its public
attributes, its private ones the captures' code
names (``reads.py`` narrows every object's attributes to those), ``_modules``, ``_parameters``
and ``_buffers``, forward hooks; the children of ``Sequential`` / ``ModuleList`` / ``ModuleDict`` on every call), the globals its
``forward`` names, objects those attributes hold that carry attributes of their own (configs,
private attributes included; two levels), torch's global forward hooks and default dtype; for a
function, its closure cells, defaults, code and the globals its code loads, a partial's
arguments, a bound or callable object's attributes, what a compiled function found among them
wraps (its model, its function's variables), the settings in the bodies of the user's own
classes a forward names (``MyFunction.SCALE`` of an autograd.Function); and the modules found among all those, as
trees (``modules_reached``: ``weights.py`` watches their tensors); the plain values in the bodies
of the user's own classes of those modules and objects (``LIMIT = 0.5``: not torch's or
transformers' classes, whose state is their version's). Not watched: torch's own private
entries of a module, library classes' attributes, imported modules' attributes, globals of the functions
the target calls, loggers and threading objects, grad mode (graphs serve inference; see README).
"""

from __future__ import annotations

import dis
import functools
import logging
import operator
import threading
import types
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from clika_runtime.base.libraries import body_values, ours
from clika_runtime.state.compare import COPIED, MODULE_HOOKS, MODULE_INTERNALS, MODULE_PRIVATE, Part, cells_part, dict_part, kept

# The names by which code asks torch's modes, by mode: a graph is traced under no_grad, outside
# inference mode, and answers for that branch only.
# (``x.is_inference()`` is not among them: ``self.is_inference = True`` would read as asking.)
MODE_READERS = {"grad": frozenset({"is_grad_enabled"}), "inference": frozenset({"is_inference_mode_enabled"})}
_READERS = {torch.is_grad_enabled: "is_grad_enabled", torch.is_inference_mode_enabled: "is_inference_mode_enabled",
            torch.is_inference: "is_inference_mode_enabled"}
_CALLED_DEPTH = 3  # levels of the user's functions followed from a forward, for the names they use
_SET_UP = frozenset({"__init__", "__post_init__", "__new__", "__del__", "__repr__"})  # not run by a call
_DEPTH = 2  # levels of attribute-carrying objects watched below a module
_SEARCHED = 4 * COPIED  # container items read a walk past that depth, for the modules they may hold
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_CODE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
         functools.partial, torch.nn.Module, torch.Tensor)
_CONTAINERS = (dict, list, tuple, set, frozenset, str, bytes)
# Loggers and threads' synchronisation objects: their state is not a value a graph is traced with.
_INERT = (logging.Logger, logging.LoggerAdapter, threading.Event, threading.Condition, threading.Semaphore,
          threading.Barrier, threading.Thread)
_CONTAINER_MODULES = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_FAST_PATH_MODULES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder)


def parts_read(fn: Any, owner: torch.nn.Module | None) -> tuple[list[Part], "_Walk"]:
    """The parts of the state ``fn`` (whose weights ``owner`` holds, if a module) reads now, and
    the walk that found them: the modules it reaches outside its owner's registered tree (see
    ``modules_reached``) and the objects whose attributes it watches (``holders``), private
    attributes of modules included (as ``hidden``: ``reads.narrowed`` keeps those the code named)."""
    walk = _Walk()
    parts: list[Part] = []
    if owner is not None:
        parts += _module_tree(owner, "", walk)
        parts += _class_forwards(owner)
        forward = _forward(fn, owner)
        for layer in _unwrapped(forward) if forward is not None else ():  # @torch.no_grad() on forward
            parts += _globals(layer, walk) if isinstance(layer, types.FunctionType) and ours(layer) else []
    else:
        for layer in _unwrapped(fn):
            parts += _callable(layer, walk)
    modes = _modes(walk.names)
    flags = ([_modes_part(modes)] if modes else []) + ([_fast_path()] if walk.attention else [])
    return parts + _global_hooks() + [_default_dtype()] + flags, walk


def modes_read(fn: Any, owner: torch.nn.Module | None) -> frozenset[str]:
    """The modes (``MODE_READERS``) the user's code ``fn`` runs asks torch for."""
    return _modes(parts_read(fn, owner)[1].names)


def _modes(names: set[str]) -> frozenset[str]:
    return frozenset(mode for mode, readers in MODE_READERS.items() if readers & names)


def modules_reached(fn: Any, owner: torch.nn.Module | None) -> list[tuple[str, torch.nn.Module]]:
    """The modules a target reads outside its owner's registered tree, by where it finds them
    (``model`` in a closure, ``the callable object.model``, ``layers.0`` in a plain list)."""
    return parts_read(fn, owner)[1].reached


@dataclass
class _Walk:
    """What building a snapshot has met: objects already watched, and the modules the target
    reaches outside its owner's registered tree (their tensors are baked as constants)."""

    seen: set[int] = field(default_factory=set)
    names: set[str] = field(default_factory=set)  # the names the user's own functions and methods walked use
    classes: set[type] = field(default_factory=set)  # the modules' classes whose methods' names are in ``names``
    code_seen: set[int] = field(default_factory=set)  # the functions whose names are in ``names``
    globals_seen: set[int] = field(default_factory=set)  # the functions whose globals are watched
    attention: bool = False  # a module whose eager answer follows ``torch.backends.mha``'s fast-path flag
    reached: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    holders: dict[int, Any] = field(default_factory=dict)  # the objects whose attributes are watched, by their dict's id
    searched: int = 0  # container items read past the depth, for modules only


def _held(value: Any, name: str, walk: _Walk, depth: int = _DEPTH) -> list[Part]:
    """What a value the target reads holds that may change: a module's tree, an object's
    attributes, and those of the modules and objects in a small container. A value that cannot
    be walked (its attributes raise) is watched by identity only, where its holder is."""
    try:
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):  # self.fn = lambda ...
            walk.names |= _names_of(value, walk.code_seen)
        elif not isinstance(value, (type, torch.nn.Module)) and ours(type(value)):  # a helper object's methods
            walk.names |= _method_names(type(value), None, walk.code_seen)
        if isinstance(value, torch.nn.Module):
            if id(value) in walk.seen:
                return []
            walk.reached.append((name, value))
            return _module_tree(value, name, walk)
        if isinstance(value, (list, tuple, dict)) and len(value) <= COPIED:  # a named tuple's models too
            # Past the depth objects are no longer watched, but modules are still found (an object's
            # dict of lists of models): their weights are baked, wherever the target finds them. That
            # search reads at most ``_SEARCHED`` items a walk (nested lists of numbers end it).
            if id(value) in walk.seen or (depth == 0 and walk.searched > _SEARCHED):
                return []  # a container holding itself ends too
            walk.seen.add(id(value))
            walk.searched += len(value) if depth == 0 else 0
            items = value.items() if isinstance(value, dict) else enumerate(value)
            return [part for key, item in items for part in _held(item, f"{name}.{key}", walk, max(depth - 1, 0))]
        if _wraps(value):  # a compiled function (a wrapper object): its target's state is the caller's too
            if id(value) in walk.seen:
                return []
            walk.seen.add(id(value))
            layers = list(_unwrapped(value))[1:]
            return [part for layer in layers for part in
                    (_held(layer, name, walk, depth) if isinstance(layer, torch.nn.Module) else _callable(layer, walk))]
        if isinstance(value, type):  # a class the code names (an autograd.Function): its settings
            return _class_bodies(value, walk)
        return _objects(value, name, walk, depth) if _carries_attributes(value) else []
    except Exception:  # a property that raises, a recursion too deep: not watched
        return []


def _module_tree(root: torch.nn.Module, prefix: str, walk: _Walk) -> list[Part]:
    parts = []
    for name, module in root.named_modules(prefix=prefix):
        if id(module) in walk.seen:
            continue
        walk.seen.add(id(module))
        walk.attention = walk.attention or isinstance(module, _FAST_PATH_MODULES)
        if type(module) not in walk.classes:
            walk.classes.add(type(module))
            walk.names |= _method_names(type(module), ("forward",), walk.code_seen)
        for key in MODULE_HOOKS:  # hooks run with the forward
            for hook in (vars(module).get(key) or {}).values():
                walk.names |= _names_of(hook, walk.code_seen)
        state = vars(module)
        walk.holders[id(state)] = module
        keys = [k for k in state if not k.startswith("_")]
        hidden = [k for k in state if k.startswith("_") and not k.startswith("__") and k not in MODULE_INTERNALS]
        where = name or "the module"
        parts.append(replace(dict_part(where, state, keys + hidden, sized=True), hidden=frozenset(hidden)))
        parts.append(replace(dict_part(where, state, [k for k in MODULE_PRIVATE if k in state], sized=False,
                                        whole=True), per_call=False))
        parts += [_sized(where, state[k]) for k in MODULE_HOOKS if state.get(k)]  # a hook removed
        if isinstance(module, _CONTAINER_MODULES):  # their forward iterates their children: a deletion shows
            parts.append(dict_part(where, state, ["_modules"], sized=False, whole=True))
        for key in keys:
            parts += _held(state[key], f"{where}.{key}" if name else key, walk)
        parts += _class_bodies(type(module), walk)
    return parts


def _class_forwards(root: torch.nn.Module) -> list[Part]:
    """Where the forward a call runs is found: in the target's class or a base before the one that
    defines it (``Model.forward = ...``), and for each fx ``GraphModule`` in the tree, in its own
    class (``gm.recompile()`` writes the new forward there)."""
    parts = []
    modules = [root, *(m for m in root.modules() if m is not root and isinstance(m, torch.fx.GraphModule))]
    for module in modules:
        for cls in type(module).__mro__:
            state = vars(cls)
            if "forward" in state:
                parts.append(dict_part(f"{cls.__qualname__}'s", state, ["forward"], sized=False))
                break
            parts.append(dict_part(f"{cls.__qualname__}'s", state, [], sized=True))  # one defined there later
    return parts


def _class_bodies(cls: type, walk: _Walk) -> list[Part]:
    """The plain values and the models in the bodies of ``cls`` and its bases that are the user's own
    classes (``self.LIMIT`` and ``cls.MODEL`` fall back to them)."""
    parts = []
    for owner in cls.__mro__:
        if id(owner) in walk.seen or not ours(owner):
            continue
        walk.seen.add(id(owner))
        models = [k for k, v in vars(owner).items() if isinstance(v, torch.nn.Module)]  # ``MODEL = load()``
        keys = body_values(owner) + models
        if keys:
            parts.append(dict_part(owner.__qualname__, vars(owner), keys, sized=False))
        for key in models:
            parts += _held(vars(owner)[key], f"{owner.__qualname__}.{key}", walk)
    return parts


def _objects(value: Any, name: str, walk: _Walk, depth: int) -> list[Part]:
    """An attribute-carrying object (a config) and those it holds, ``depth`` levels down; its
    private attributes too (transformers keeps ``_attn_implementation`` there)."""
    if depth == 0 or id(value) in walk.seen:
        return []
    walk.seen.add(id(value))
    state = vars(value)
    keys = [k for k in state if not k.startswith("__")]
    if len(keys) > 4 * COPIED:  # not a config: a big object held by reference, watched by identity
        return []
    walk.holders[id(state)] = value
    parts = [dict_part(name, state, keys, sized=True)]
    for key in keys:
        parts += _held(state[key], f"{name}.{key}", walk, depth - 1)
    return parts + _class_bodies(type(value), walk)


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
        walk.names |= {_READERS[v] for v in (*fn.args, *fn.keywords.values()) if _is_reader(v)}
        parts = [Part("the partial's", fn, ("args", "keywords"), operator.attrgetter("args", "keywords"),
                      (kept(fn.args), kept(fn.keywords)), None, variables=True)]
        return parts + _held(fn.args, "argument", walk) + _held(fn.keywords, "keyword", walk)
    inner = getattr(fn, "__func__", fn)
    parts = _function(inner, walk) if isinstance(inner, types.FunctionType) else []
    if inner is not fn:
        held, name = getattr(fn, "__self__", None), "the bound object"
    else:
        held, name = (None if hasattr(fn, "__wrapped__") else fn), "the callable object"
    if isinstance(held, type):  # a class method: the class's body (``cls.MODEL``)
        parts += _class_bodies(held, walk)
    elif held is not None and not isinstance(held, _CODE + _CONTAINERS) \
            and isinstance(getattr(held, "__dict__", None), dict):
        parts += _objects(held, name, walk, _DEPTH)
    if held is not None and _safely(lambda: ours(type(held))):  # a callable object: __call__ and what it calls
        walk.names |= _method_names(type(held), None, walk.code_seen)
    return parts


def _function(fn: types.FunctionType, walk: _Walk, depth: int = _CALLED_DEPTH) -> list[Part]:
    """A function's defaults, code, closure cells and globals, and what those hold (a model as a
    default argument: ``def predict(x, model=model)``); the user's functions it calls, ``depth``
    calls down (``_globals``)."""
    walk.seen.add(id(fn))
    walk.names |= _code_names(fn, walk.code_seen) if ours(fn) else set()
    parts = [Part(f"{fn.__qualname__}'s", fn, ("__defaults__", "__kwdefaults__", "__code__"),
                  operator.attrgetter("__defaults__", "__kwdefaults__", "__code__"),
                  (kept(fn.__defaults__), kept(fn.__kwdefaults__), fn.__code__), None, variables=True)]
    cells = tuple(c for c in fn.__closure__ or () if filled(c))
    names = dict(zip((id(c) for c in fn.__closure__ or ()), fn.__code__.co_freevars))
    if cells:
        parts.append(cells_part(cells, tuple(names[id(c)] for c in cells)))
    for cell in cells:
        parts += _held(cell.cell_contents, names[id(cell)], walk)
    for name, value in _defaults(fn):
        parts += _held(value, name, walk)
    return parts + _globals(fn, walk, depth)


def _defaults(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """A function's default values, by the names of their parameters."""
    code = fn.__code__
    positional = code.co_varnames[:code.co_argcount]
    found = list(zip(positional[len(positional) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
    return found + list((fn.__kwdefaults__ or {}).items())


def _globals(fn: types.FunctionType, walk: _Walk, depth: int = _CALLED_DEPTH) -> list[Part]:
    """The globals ``fn``'s code names (modules aside: ``torch``, ``F``) and what they hold; and
    those of the user's functions it calls, ``depth`` calls down (named as globals or closed
    over: a helper calling a global model, a decorator's wrapper calling the function it wraps)."""
    if id(fn) in walk.globals_seen:
        return []
    walk.globals_seen.add(id(fn))
    namespace = fn.__globals__
    read = sorted({k for k in global_names(fn.__code__) if k in namespace and not isinstance(namespace[k], types.ModuleType)})
    parts = [replace(dict_part("global", namespace, read, sized=False), variables=True)] if read else []
    for name in read:
        parts += _held(namespace[name], name, walk)
    if depth > 0:
        called = [namespace[name] for name in read] + [c.cell_contents for c in fn.__closure__ or () if filled(c)]
        for inner in called:  # what they hold too: a global ``encode = make_encoder(model)`` closes over its model
            if isinstance(inner, types.FunctionType) and ours(inner) and id(inner) not in walk.seen:
                parts += _function(inner, walk, depth - 1)
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
    global_hooks = replace(dict_part("torch's", namespace, hooks, sized=False), variables=True, per_call=False)
    return [made, global_hooks] + [_sized("torch's", namespace[name]) for name in hooks if namespace[name]]


def _default_dtype() -> Part:
    """``torch.set_default_dtype``: what tensors made without a dtype are (``torch.ones(3)``)."""
    return Part("torch's", torch, ("default dtype",), _get_default_dtype, (torch.get_default_dtype(),), None,
                variables=True, per_call=False)  # read inline per call


def _get_default_dtype(_: Any) -> torch.dtype:
    return torch.get_default_dtype()


def _modes_part(modes: frozenset[str]) -> Part:
    """Grad and inference mode, for code that asks (``y * 2 if torch.is_grad_enabled() else y``): a
    call with frozen weights is served in any of them, so a graph traced under ``no_grad`` served
    the other branch. Watched only where the user's code asks; torch's modules ask for grad mode
    only beside weights that require grad, calls that run eagerly."""
    keys = tuple(f"{mode} mode" for mode in sorted(modes))
    read = _get_modes if len(keys) == 2 else _get_grad_mode if "grad" in modes else _get_inference_mode
    return Part("torch's", torch.autograd, keys, read, read(None) if len(keys) == 2 else (read(None),), None,
                variables=True)


def _get_modes(_: Any) -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _get_grad_mode(_: Any) -> bool:
    return torch.is_grad_enabled()


def _get_inference_mode(_: Any) -> bool:
    return torch.is_inference_mode_enabled()


def _fast_path() -> Part:
    """``torch.backends.mha.set_fastpath_enabled``: in eval mode without grad, attention and
    transformer encoder layers take a fused path that leaves padded positions otherwise than
    the plain one (zeros, not values)."""
    return Part("torch's", torch.backends.mha, ("attention fast path",), _get_fast_path,
                (torch.backends.mha.get_fastpath_enabled(),), None, variables=True)


def _get_fast_path(_: Any) -> bool:
    return torch.backends.mha.get_fastpath_enabled()


def _method_names(cls: type, start: tuple[str, ...] | None, seen: set[int]) -> set[str]:
    """The names used by the functions in the bodies of ``cls`` and its bases, for the user's own
    classes: those reached from the methods named ``start`` through ``self.<name>`` (a module's
    forward and its helpers, not its training step), or, ``start`` None, all but the set-up ones."""
    body: dict[str, Any] = {}
    for owner in reversed(cls.__mro__):
        if ours(owner):
            body.update(vars(owner))
    queue = list(start) if start is not None else [name for name in body if name not in _SET_UP]
    names: set[str] = set()
    while queue:
        name = queue.pop()
        if name not in body:
            continue
        used = _names_of(body.pop(name), seen)
        queue += [n for n in used - names if n in body]
        names |= used
    return names


def _names_of(value: Any, seen: set[int]) -> set[str]:
    """The names a function uses; a method's, a static or class method's, a partial's, what a
    decorator wraps; a decorator object of the user's class: its methods'."""
    for _ in range(4):  # unwrapping, a few layers
        if isinstance(value, types.FunctionType) and (ours(value) or not hasattr(value, "__wrapped__")):
            return _code_names(value, seen) if ours(value) else set()
        if isinstance(value, type):
            return set()
        inner = _safely(lambda v=value: getattr(v, "__func__", None) or getattr(v, "func", None)
                        or vars(v).get("__wrapped__"))
        if inner is None:
            return _method_names(type(value), None, seen) if _safely(lambda v=value: ours(type(v))) else set()
        value = inner
    return set()


def _code_names(fn: types.FunctionType, seen: set[int], depth: int = _CALLED_DEPTH) -> set[str]:
    """Every global and attribute name ``fn``'s code (and the functions it defines) uses, a torch
    mode reader it holds under another name (``from torch import is_grad_enabled as on``, in a
    closure), and the names of the user's functions it reaches, ``depth`` calls down: named as
    globals, attributes of the user's modules (``helpers.probe()``) or closed over. Each function
    once per walk (``seen``): helpers calling each other made the walk grow as their cube."""
    if id(fn) in seen:
        return set()
    seen.add(id(fn))
    names = all_names(fn.__code__)
    held = [fn.__globals__.get(name) for name in set(global_names(fn.__code__))]
    held += [cell.cell_contents for cell in fn.__closure__ or () if filled(cell)]
    held += [_safely(lambda m=module, n=name: getattr(m, n, None)) for module in held
             if isinstance(module, types.ModuleType) and _safely(lambda m=module: ours(m)) for name in names]
    names |= {_READERS[value] for value in held if _is_reader(value)}
    if depth > 0:
        for called in held:
            if isinstance(called, types.FunctionType) and ours(called):
                names |= _code_names(called, seen, depth - 1)
    return names


def _safely(read: Any) -> Any:
    """``read()``, or None where it raises (a module's ``__getattr__`` raising a KeyError)."""
    try:
        return read()
    except Exception:
        return None


def _is_reader(value: Any) -> bool:
    try:
        return value in _READERS
    except Exception:  # unhashable, or a __hash__ or __eq__ of its own that raises
        return False


def _sized(name: str, hooks: dict) -> Part:
    """The length of a dictionary of hooks that has some: removing one makes no new handle."""
    return Part(name, hooks, (), None, (), len(hooks), trigger=True)


def all_names(code: types.CodeType) -> set[str]:
    """Every global and attribute name a code object (and the functions it defines) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= all_names(const)
    return names


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


def _wraps(value: Any) -> bool:
    """An object, not a function, that wraps a callable (``__wrapped__``): a compiled function
    called from the target, whose graph the target's capture traces through and bakes."""
    return not isinstance(value, _CODE) and callable(value) and getattr(value, "__wrapped__", None) is not None


def _carries_attributes(value: Any) -> bool:
    """A plain object with attributes of its own (a config, a namespace, a callable object of the
    user's holding a model), not code or a module."""
    return value is not None and not isinstance(value, _CODE + _CONTAINERS + _INERT) \
        and (not callable(value) or _safely(lambda: ours(type(value)))) \
        and isinstance(getattr(value, "__dict__", None), dict)
