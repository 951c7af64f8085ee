"""Fingerprints for the on-disk capture cache: what decides a graph, as a hex digest.

A function's fingerprint covers its code (the target's function, or every submodule class's
``forward`` with the module's plain attributes and config; the files that code is written in and
the plain values of the globals it names), the content of its weights, buffers
and closed-over tensors, the compile options, and the versions of the libraries that make the
graph (this library's own source by content). A capture's fingerprint adds the call key and the
plan (dynamic axes, tied axes, lifted numbers, the sizes of static axes). These are "as far as
cheaply knowable": a cached graph is still verified against the first call's eager result before
it serves anything.

Weights are hashed once per tensor version: the digest is kept per tensor and reused while its
version counter and data pointer stay the same. SHA-256 (twice blake2b's speed on CPUs with SHA
instructions), several tensors at once when there is much to hash: hashlib releases the GIL.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.metadata
import os
import sys
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

import exporters
import serving
from clika_runtime.base.libraries import LIBRARIES, body_values, code_name, library_package, ours
from clika_runtime.base.precision import FP32
from clika_runtime.base.sharing import TARGETS
from clika_runtime.base.version import VERSION
from clika_runtime.capture.plan import CapturePlan
from clika_runtime.capture.target import Target
from clika_runtime.state.walk import all_names, filled, global_names, modules_reached
from clika_runtime.state.weights import closure_tensors
from clika_runtime.trees.key import static_value

# id(storage) -> (a weak reference to it, {view: (the tensor's version when hashed, the digest)}).
_DIGESTS: dict[int, tuple[weakref.ref, dict[tuple, tuple[int | None, str]]]] = {}
# Past this many bytes of tensors, they are hashed on several threads (BERT-base: 440 MB, 0.24 s on one).
_PARALLEL_BYTES = 64 * 2**20


def function_key(target: Target) -> str:
    """The digest of everything a function's graphs depend on but its calls. Reads the module as
    an eager call does (holding ``TARGETS`` shared): an export elsewhere swaps its parameters."""
    with TARGETS.shared():
        reached = modules_reached(target.fn, target.owner)  # one walk for both (6 ms for BERT-base)
        digest = hashlib.sha256(code_key(target, reached).encode())
        tensors = _bakeable(target, reached)
        for (name, _), tensor_hex in zip(tensors, _digests([t for _, t in tensors])):
            digest.update(name.encode())
            digest.update(tensor_hex.encode())
    return digest.hexdigest()


def code_key(target: Target, reached: list[tuple[str, torch.nn.Module]] | None = None) -> str:
    """The digest of a function without its weights' values (their names, dtypes and shapes
    only): what an earlier process learned about its calls' axes is keyed by it, so it is read
    before the first call without hashing the weights. ``reached``: the target's
    ``modules_reached``, when the caller has walked for them already."""
    digest = hashlib.sha256()
    with TARGETS.shared():
        if reached is None:
            reached = modules_reached(target.fn, target.owner)
        for part in (_versions(), _options(target), _code(target.fn, target.owner, reached), _sources(target.fn),
                     _hooks(torch.nn.modules.module, ("_global_forward_pre_hooks", "_global_forward_hooks"))):
            digest.update(part.encode())
        for name, tensor in _bakeable(target, reached):
            digest.update(f"{name}:{tensor.dtype}{tuple(tensor.shape)}".encode())
    return digest.hexdigest()


def warm(target: Target) -> None:
    """Hash the target's weights now (one thread), so a ``function_key`` soon after finds them
    hashed: run beside a capture's eager call, which it overlaps (``restore.ahead``)."""
    with TARGETS.shared():
        tensors = [t for _, t in _bakeable(target)]
    for tensor in tensors:
        with TARGETS.shared():  # between tensors, an export elsewhere may take its turn
            tensor_digest(tensor)


def _digests(tensors: list[torch.Tensor]) -> list[str]:
    if sum(t.numel() * t.element_size() for t in tensors) < _PARALLEL_BYTES:
        return [tensor_digest(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(tensor_digest, tensors))


def capture_key(function: str, plan: CapturePlan, place: str) -> str:
    """The digest of one capture: its function, call key, plan and place."""
    call = plan.call
    shapes = [
        [("*" if a in axes else size) for a, size in enumerate(v.shape)] if isinstance(v, torch.Tensor) else "number"
        for v, axes in zip(call.feeds, plan.dynamic)
    ]
    parts = [function, str(call.key.structure), _statics(call.key.statics),
             repr([(str(d), r, str(dev)) for d, r, dev, *_ in call.key.tensors]), repr(call.key.tensor_at),
             repr(call.key.training), _torch_settings(),
             repr(shapes), repr(sorted(call.lifted)), repr([sorted(d.items(), key=str) for d in plan.dynamic]),
             repr(plan.ties), repr(plan.variant), place]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _torch_settings() -> str:
    """The process-wide settings of torch a trace follows (watched per call in a process: state/walk):
    the default dtype, and the attention fast path (padded positions zero, or computed)."""
    return repr((torch.get_default_dtype(), torch.backends.mha.get_fastpath_enabled()))


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes (cached while it is unchanged).

    Kept per storage, by a weak reference to the storage, not to the tensor: the weak reference
    stops a dead storage's id, reused, from reading as unchanged, and ``torch.utils.swap_tensors``
    refuses a tensor that has one (``model.to(...)`` under ``torch.__future__.
    set_swap_module_params_on_conversion(True)``). Within a storage, each view (offset, shape,
    strides, dtype) keeps its digest with the version it was taken at."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no plain storage (a sparse tensor): hashed each time
        return _digest(tensor)
    view = (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
    version = None if tensor.is_inference() else tensor._version
    entry = _DIGESTS.get(id(storage))
    if entry is None or entry[0]() is not storage:
        key = id(storage)
        entry = _DIGESTS[key] = (weakref.ref(storage, lambda _, key=key: _DIGESTS.pop(key, None)), {})
    cached = entry[1].get(view)
    if cached is not None and version is not None and cached[0] == version:
        return cached[1]
    digest = _digest(tensor)
    entry[1][view] = (version, digest)
    return digest


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.view(torch.int16)
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy() if data.dtype != torch.bool else data.numpy())
    return digest.hexdigest()


def _bakeable(target: Target, reached: list[tuple[str, torch.nn.Module]] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a capture of ``target`` may bake: the owner's, those of the modules its code
    reaches through a global or a closure (``state.walk.modules_reached``, or ``reached``), and
    those it closes over."""
    found: list[tuple[str, torch.Tensor]] = []
    if reached is None:
        reached = modules_reached(target.fn, target.owner)
    owned = [("", target.owner)] if target.owner is not None else []
    for prefix, module in owned + [(f"{where}.", module) for where, module in reached]:
        found += [(prefix + name, t) for name, t in [*module.named_parameters(), *module.named_buffers()]]
        found += [(prefix + name, t) for name, t in _attribute_tensors(module)]
    found += closure_tensors(target.fn)
    return found


_REGISTERED = frozenset({"_parameters", "_buffers", "_modules"})  # a module's own registries, listed apart


def _attribute_tensors(owner: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors modules hold as plain attributes (``self.table = torch.zeros(10)``), directly or in
    a list, tuple or dict: the exporter bakes them as it bakes buffers."""
    found = []
    for prefix, module in owner.named_modules():
        for key, value in vars(module).items():
            if key in _REGISTERED:
                continue
            name = f"{prefix}.{key}" if prefix else key
            items = value.items() if isinstance(value, dict) else enumerate(value) \
                if isinstance(value, (list, tuple)) else [(None, value)]
            found += [(name if i is None else f"{name}[{i!r}]", v) for i, v in items if isinstance(v, torch.Tensor)]
    return found


def forget(target: Target) -> None:
    """Hash the target's tensors afresh next time: a write through ``.data`` moves neither their
    version nor their memory, so after one the digests kept for them are stale (``reset()``)."""
    for _, tensor in _bakeable(target):
        try:
            _DIGESTS.pop(id(tensor.untyped_storage()), None)
        except (RuntimeError, NotImplementedError):  # no plain storage: never kept
            pass


@functools.cache
def _own_code() -> str:
    """A digest of this library's source (clika_runtime, exporters, serving): a graph another state
    of the code made (a checkout, an edited install, both at one version string) is not served.
    Read once per process: about 120 files, a few milliseconds."""
    digest = hashlib.sha256()
    for folder in (Path(__file__).resolve().parents[1], Path(exporters.__file__).parent, Path(serving.__file__).parent):
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _versions() -> str:
    versions = [f"clika_runtime {VERSION} {_own_code()}", f"python {sys.version_info[:3]}"]
    for name in LIBRARIES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} -")
    return ";".join(versions)


def _options(target: Target) -> str:
    o = target.options
    return repr((o.signature, o.dynamic, sorted((k, sorted(v.items())) for k, v in o.dynamic_axes.items()),
                 o.specialize, target.optimize, target.output_names, target.graph_name, target.precision,
                 target.agreement_now() if target.precision != FP32 else None))


def _code(fn: Any, owner: torch.nn.Module | None, reached: list[tuple[str, torch.nn.Module]]) -> str:
    """The code a call runs, as far as cheaply knowable: functions' bytecode and constants, each
    submodule class's forward, the modules' plain attributes (sizes, flags, configs) and hooks,
    and the modules the target reaches through a global or a closure."""
    text = _tree(fn) if isinstance(fn, torch.nn.Module) else _function(getattr(fn, "__func__", fn))
    bound = getattr(fn, "__self__", None)
    text += "|" + _tree(bound) if isinstance(bound, torch.nn.Module) else ""
    return text + "".join(f"|{where}={_tree(m)}" for where, m in reached)


def _tree(module: torch.nn.Module) -> str:
    return "|".join(f"{name}:{_module(m)}" for name, m in module.named_modules())


def _hooks(holder: Any, kinds: tuple[str, ...]) -> str:
    """The forward hooks ``holder`` keeps, by their code: what they compute is in the graph."""
    held = [(kind, getattr(holder, kind, None) or {}) for kind in kinds]
    return "".join(f";{kind}=[{','.join(_plain(h) for h in hooks.values())}]" for kind, hooks in held if hooks)


def _module(module: torch.nn.Module) -> str:
    """A module's class, its forward, its plain attributes (the instance's, and those of its own
    classes: ``LIMIT = float(os.environ[...])`` in a class body) and its forward hooks."""
    cls = type(module)
    attributes = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or isinstance(value, (torch.Tensor, torch.nn.Module)):
            continue
        attributes.append(f"{key}={_plain(value)}")
    for owner in (c for c in cls.__mro__ if ours(c)):  # methods are keyed by ``_sources``
        attributes += [f"{owner.__qualname__}.{key}={_plain(vars(owner)[key])}" for key in sorted(body_values(owner))]
    hooks = _hooks(module, ("_forward_pre_hooks", "_forward_hooks"))
    return f"{cls.__module__}.{cls.__qualname__}[{_function(cls.forward)}]({','.join(attributes)}){hooks}"


def _sources(fn: Any) -> str:
    """The files the call's code is written in, by content, with its classes' methods and the
    plain values of the globals they (or the function) name and it closes over (a setting given to
    a factory varies between runs of one file): an edited constant or helper method
    changes what the graph computes, not the forward's bytecode. Code typed into a notebook has
    no file: the methods and values stand in. torch's own code is keyed by its version.

    What that code reads outside its own file is followed too (``_reached``): the values and
    helpers of the user's modules it names (``settings.LIMIT``, set from the environment when
    ``settings`` was imported), the environment variables it reads by name, and the files its
    plain values name (a path read at call time): the graph bakes them, and a first call that
    lands inside both limits of a clamp verifies the graph made under either."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    modules = list(owner.modules()) if isinstance(owner, torch.nn.Module) else []
    classes = {c for m in modules for c in type(m).__mro__ if ours(c)}
    functions = [f for c in classes for f in vars(c).values() if isinstance(f, types.FunctionType) and ours(f)]
    if isinstance(inner := getattr(fn, "__func__", fn), types.FunctionType):
        functions.append(inner)
        functions += [v for _, v in _closure(inner) if isinstance(v, types.FunctionType)]  # helpers it closes over
    functions, named, files = _reached(functions)
    named |= {(f.__qualname__, n): v for f in functions for n, v in _closure(f)}  # make_predict(clamp)'s clamp
    named |= {(f.__qualname__, n): v for f in functions for n, v in _defaults(f)}  # lambda x, c=ceil: ...
    files |= {_file(c) for c in classes} | {_file(f) for f in functions}
    files |= {_file(v) for v in named.values() if isinstance(v, (type, types.FunctionType)) and ours(v)}
    values = sorted(f"{m}.{n}={_plain(v)}" for (m, n), v in named.items()
                    if not isinstance(v, (type, types.FunctionType, types.ModuleType)))
    files |= {v for v in named.values() if _names_a_file(v)} | {v for m in modules for v in vars(m).values()
                                                                 if _names_a_file(v)}
    methods = sorted(_function(f) for f in functions)
    return "|".join(values + methods + _environment(functions, named)
                    + [f"{path}:{_file_digest(path)}" for path in sorted(p for p in files if p)])


_REACHED = 256  # functions followed at most: a key, not a whole-program walk


def _reached(functions: list[types.FunctionType]) -> tuple[list[types.FunctionType], dict, set]:
    """``functions`` and the user's functions they reach through globals and modules they name,
    with what they read there, by (where, name), and the files of the user's modules and classes."""
    seen, queue, named, files = [], list(functions), {}, set()
    while queue and len(seen) < _REACHED:
        f = queue.pop()
        if f in seen:
            continue
        seen.append(f)
        attributes = all_names(f.__code__)
        for n in global_names(f.__code__):
            if n in f.__globals__:
                value = named[(f.__module__, n)] = f.__globals__[n]
                _read_from(f"{f.__module__}.{n}", value, attributes, named, queue, files)
    return seen, named, files


def _read_from(where: str, value: Any, attributes: set[str], named: dict, queue: list, files: set,
               depth: int = 2) -> None:
    """What code reads of ``value`` by the attribute names it uses (``settings.LIMIT``,
    ``CONFIG.scale``, ``Conf.K``, ``settings.CONFIG.scale``: two levels), into ``named``; the user's
    functions it reaches join ``queue``."""
    if isinstance(value, types.FunctionType):
        if _user_code(value):
            queue.append(value)
        return
    if depth == 0 or isinstance(value, torch.nn.Module):  # (a module's weights and attributes are keyed apart)
        return
    if isinstance(value, (types.ModuleType, type)):
        if not _user_code(value):
            return
        files.add(getattr(value, "__file__", None) if isinstance(value, types.ModuleType) else _file(value))
    elif not isinstance(getattr(value, "__dict__", None), dict):
        return
    space = vars(value)  # a module's globals, a class's attributes, an object's (a config, a namespace)
    for a in attributes & set(space):
        named[(where, a)] = space[a]
        _read_from(f"{where}.{a}", space[a], attributes, named, queue, files, depth - 1)


def _user_code(code: Any) -> bool:
    """The user's own code (a function or a module): ``ours``, and not an installed package
    (numpy's, timm's)."""
    if isinstance(code, types.ModuleType):
        package, path = code.__name__.split(".")[0], getattr(code, "__file__", None) or ""
        own = not library_package(package)
    else:
        own, path = ours(code), _file(code) or ""
    return own and "-packages" + os.sep not in path


def _environment(functions: list[types.FunctionType], named: dict) -> list[str]:
    """The environment variables the functions may read by name (``os.environ.get("LIMIT")``,
    ``os.getenv(NAME)``): when one reads the environment, every string constant of it and every
    string value they name."""
    readers = [f for f in functions if {"environ", "getenv"} & all_names(f.__code__)]
    if not readers:
        return []
    names = {c for f in readers for c in _strings(f.__code__)} | {v for v in named.values() if isinstance(v, str)}
    return sorted(f"${c}={os.environ.get(c)!r}" for c in names if 0 < len(c) < 256)


def _strings(code: types.CodeType) -> Iterable[str]:
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, types.CodeType):
            yield from _strings(const)


def _names_a_file(value: Any) -> bool:
    """A plain string that is the path of a file (a setting read at call time)."""
    return isinstance(value, str) and 0 < len(value) < 4096 and "\n" not in value and os.path.isfile(value)


def _defaults(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """A function's default values, by parameter name (a factory's setting bound as a default)."""
    code = fn.__code__
    positional = code.co_varnames[:code.co_argcount]
    found = list(zip(positional[len(positional) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
    return found + sorted((fn.__kwdefaults__ or {}).items())


def _closure(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """The variables a function closes over, by name, but empty cells."""
    cells = zip(fn.__code__.co_freevars, fn.__closure__ or ())
    return [(name, cell.cell_contents) for name, cell in cells if filled(cell)]


def _file(code: Any) -> str | None:
    """Where a class or function is written, if in a file."""
    if isinstance(code, types.FunctionType):
        return code.__code__.co_filename
    return getattr(sys.modules.get(code.__module__), "__file__", None)


_DIGESTED_BYTES = 2**20  # a larger file (weights a path names) is known by its time and size


@functools.lru_cache(maxsize=256)
def _file_digest_at(path: str, stamp: tuple[int, int]) -> str:
    if stamp[1] > _DIGESTED_BYTES:
        return f"{stamp[0]}:{stamp[1]}"
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()[:24]


def _file_digest(path: str) -> str:
    """A file's content digest (read again only when its time or size moves); '' for none."""
    try:
        stat = os.stat(path)
        return _file_digest_at(path, (stat.st_mtime_ns, stat.st_size))
    except OSError:  # "<stdin>", "<string>", a file deleted since: its code's values stand in
        return ""


def _plain(value: Any, depth: int = 4) -> str:
    """A stable text of an attribute's value (configs by their dict; functions by their code, the
    values they close over and their defaults; partials by their function and arguments; other
    objects by their fields' values, or as this process's object where those cannot be read: by
    its type alone, ``Act("identity")`` found ``Act("relu")``'s graph; containers ``depth``
    levels down, then by their length)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (functools.partial, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return _callable(value, depth)
    if isinstance(value, (tuple, list, dict)):
        if depth <= 0:
            return f"{type(value).__qualname__}[{len(value)}]"
        if isinstance(value, dict):  # SETTINGS = {"limit": 5.0}
            return "{" + ",".join(sorted(f"{k!r}:{_plain(v, depth - 1)}" for k, v in value.items())) + "}"
        return "[" + ",".join(_plain(v, depth - 1) for v in value) + "]"
    if isinstance(value, (enum.Enum, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (torch.Tensor, torch.nn.Module)):  # keyed where they are read: weights, modules reached
        return type(value).__qualname__
    if isinstance(value, np.ndarray):  # anchors, a lookup table: by content
        content = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:24]
        return f"ndarray({value.dtype},{value.shape},{content})"
    try:
        return _object(value, depth)
    except Exception:  # fields that cannot be read as values, or that raise: this process's object alone
        return f"{type(value).__qualname__} of process {os.getpid()} at {id(value):x}"


def _object(value: Any, depth: int) -> str:
    """An object as ``_plain`` writes it; raises where its value cannot be read."""
    wrapped = vars(value).get("__wrapped__") if isinstance(getattr(value, "__dict__", None), dict) else None
    if wrapped is not None and wrapped is not value and depth > 0:  # ``model.forward = cr.compile(model.forward)``
        return f"wrapping({_plain(wrapped, depth - 1)})"  # (its own: a config's __getattr__ answers any name)
    to_dict = getattr(type(value), "to_dict", None)
    if callable(to_dict):
        try:  # a transformers config leaves out the attention implementation, which changes the graph
            return repr(sorted((str(k), repr(v)) for k, v in value.to_dict().items())) + \
                repr(getattr(value, "_attn_implementation", None))
        except Exception:  # a to_dict that needs arguments: read as any other object below
            pass
    return _stable(static_value(value))  # by the value of its fields, as a static argument is keyed


def _callable(value: Any, depth: int) -> str:
    """A function a module holds as a value (``self.act = partial(F.gelu, approximate="tanh")``)."""
    if isinstance(value, functools.partial):
        return f"partial({_plain(value.func, depth)},{_plain(list(value.args), depth - 1)}," \
               f"{_plain(value.keywords, depth - 1)})"
    if isinstance(value, types.MethodType):  # with the object it is bound to: Scaler(2.0).apply is not Scaler(3.0)'s
        owner = value.__self__  # a module's own fields are read where the tree is; modules are not values
        bound = type(owner).__qualname__ if isinstance(owner, torch.nn.Module) else _plain(owner, depth - 1)
        return f"method({_plain(value.__func__, depth)},{bound})"
    if isinstance(value, types.BuiltinFunctionType):  # torch.relu, math.sqrt
        return f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    held = [*_closure(value), *_defaults(value)] if depth > 0 else []
    return f"{_function(value)}({','.join(f'{name}={_plain(v, depth - 1)}' for name, v in held)})"


def _function(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__qualname__', '')}:{_code_object(code)}"


def _code_object(code: types.CodeType) -> str:
    digest = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        digest.update((_code_object(const) if isinstance(const, types.CodeType) else repr(const)).encode())
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()[:24]


_PLAIN_GLOBALS = (bool, int, float, str, bytes, type(None))


def _statics(statics: Iterable[Any]) -> str:
    """Static values as stable text, whole (an object's by its fields' values: its class alone let
    ``Act("identity")`` find ``Act("relu")``'s graph), code by its qualified name and its bytecode's
    digest, not its address."""
    return "|".join(map(_stable, statics))


def _stable(value: Any) -> str:
    if isinstance(value, tuple):  # a static's form (key.static_value): nested tuples to its leaves
        return "(" + ",".join(map(_stable, value)) + ")"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type)):
        return _code_static(value)
    return repr(value)


def _code_static(code: Any) -> str:
    """Code passed as a static argument, keyed in memory by identity. Its name and bytecode say
    what it computes only where it holds no state: a module-level function without closure or
    defaults (with the plain globals it names), a module-level class, a builtin not bound to an
    object. A method bound to an object (``Scaler(2.0).apply``: named alike for ``Scaler(3.0)``, it
    was served the other's graph), a closure, a local class key this process's object alone."""
    self = getattr(code, "__self__", None)
    bound = isinstance(code, (types.MethodType, types.BuiltinMethodType)) and \
        not isinstance(self, (types.ModuleType, type(None)))
    state = any(getattr(code, name, None) for name in ("__closure__", "__defaults__", "__kwdefaults__"))
    if bound or state or "<locals>" in getattr(code, "__qualname__", ""):
        return f"code {code_name(code)} of process {os.getpid()} at {id(self if bound else code):x}"
    if isinstance(code, types.FunctionType):
        names = sorted(n for n in global_names(code.__code__) if isinstance(code.__globals__.get(n), _PLAIN_GLOBALS))
        return f"code {code.__module__}.{_function(code)}({','.join(f'{n}={code.__globals__[n]!r}' for n in names)})"
    return f"code {code_name(code)}"
