"""The tensors a graph baked in (weights, buffers, closed-over tensors), and the per-call check
that they are still the ones the target would use.

A graph holds copies of the tensors it was exported with. After ``load_state_dict``, an in-place
update (``p.mul_(3)`` under ``no_grad``), ``p.data = ...``, a re-registered parameter or
submodule, or a rebound closed-over tensor, that copy is stale. What each of those changes:

- in-place writes bump the tensor's version counter (``_version``), which only ever grows: the
  sum of the versions equals the sum at capture exactly when none moved (a fused optimizer's
  step, which moves none, is made to: ``_stepped``);
- ``p.data = ...`` keeps the version but moves ``data_ptr()``; a detached view of the old
  storage is held, so the old address cannot be reused by a new tensor and read as unchanged;
- assigning a parameter, buffer or submodule runs torch's global registration hooks, which bump
  one process-wide counter; on a bump, each baked name is looked up again in its module;
- a closed-over tensor rebound to a new object is seen by comparing the closure cell or global;
- a tensor written straight into a module's ``_parameters`` / ``_buffers`` (no hook runs:
  accelerate, ``torch.func.functional_call``) is seen because a module's tensors are read per
  call through those entries (``Baked.place``).

Inference tensors (made under ``torch.inference_mode()``) keep no version counter: their
in-place updates cannot be seen (their ``data_ptr`` still is); the capture notes say so.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from clika_runtime.state.unchanged import weights_unchanged
from clika_runtime.state.walk import global_names, modules_reached

logger = logging.getLogger("clika_runtime")
_data_ptr = torch.Tensor.data_ptr
# Bumped by torch whenever any module registers a parameter, buffer or submodule (assignment included).
_REGISTRATIONS = [0]
_hooked = False


def _bump(*_: Any) -> None:
    _REGISTRATIONS[0] += 1


def watch_registrations() -> None:
    """Install, once per process, torch's global registration hooks (they only count) and an
    optimizer step hook that makes a fused step visible (``_stepped``)."""
    global _hooked
    if _hooked:
        return
    from torch.nn.modules import module

    for register in ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook",
                     "register_module_module_registration_hook"):
        hook = getattr(module, register, None)
        if hook is not None:  # older torch: re-registration is then seen through data_ptr only
            hook(_bump)
    from torch.optim import optimizer

    optimizer.register_optimizer_step_post_hook(_stepped)
    _hooked = True


def _stepped(step: Any, *_: Any) -> None:
    """After any optimizer's step: the version of each parameter it stepped (those with a
    gradient) moves. torch's fused optimizers (``fused=True``) write parameters through their
    kernels' pointers and move none (torch 2.13), so a graph would serve the weights of before the
    step; a step that moved them already moves them once more, which changes nothing but the count
    (torch's ``increment_version`` is there for kernels that write behind autograd's back)."""
    try:
        stepped = [p for group in step.param_groups for p in group["params"]
                   if isinstance(p, torch.Tensor) and p.grad is not None]
        if stepped:
            torch.autograd.graph.increment_version(stepped)
    except Exception:  # an optimizer of unusual make (param_groups of its own): never fail the user's step
        logger.debug("optimizer step not counted", exc_info=True)


@dataclass(frozen=True)
class Baked:
    """One baked tensor: where it came from, the object itself, and its state at capture."""

    name: str  # "fc.weight" for a module's tensor, the variable name for a closed-over one
    tensor: torch.Tensor
    held: torch.Tensor  # a detached view of its storage at capture: keeps that address from reuse
    version: int | None  # None: an inference tensor (no version counter)
    pointer: int
    lookup: Callable[[], Any] | None  # where the target finds it now (None: nowhere to look again)
    rebinds: bool = False  # found in a closure cell or global: checked on every call, not on registrations
    reached: bool = False  # a module the target reaches outside its owner holds it (a model a lambda calls)
    place: tuple[dict, str] | None = None  # the module's ``_parameters`` / ``_buffers`` entry holding it

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, lookup: Callable[[], Any] | None, rebinds: bool = False,
           reached: bool = False, root: torch.nn.Module | None = None) -> "Baked":
        """Record ``tensor`` as it is now (``root``: the module ``name`` is a path in)."""
        place = _place(root, name, tensor) if root is not None else None
        return cls(name, tensor, tensor.detach(), _version_of(tensor), tensor.data_ptr(), lookup, rebinds, reached,
                   place)

    @property
    def kind(self) -> str:
        """Where the tensor is found: ``"module"``, ``"closure"``, ``"reached"`` (a module found
        through the target's variables) or ``"constant"`` (nowhere to look)."""
        if self.rebinds or self.reached:
            return "closure" if self.rebinds else "reached"
        return "module" if self.lookup is not None else "constant"

    def changed(self) -> bool:
        """Whether the target would now read something else than what the graph baked."""
        if self.lookup is not None and _lookup(self.lookup) is not self.tensor:
            return True
        return self.tensor.data_ptr() != self.pointer or _version_of(self.tensor) != self.version


def _place(root: torch.nn.Module, name: str, tensor: torch.Tensor) -> tuple[dict, str] | None:
    """The ``_parameters`` or ``_buffers`` entry of ``root``'s submodule at ``name`` that holds
    ``tensor``: a write straight into it (accelerate's ``set_module_tensor_to_device``,
    ``torch.func.functional_call``) runs no registration hook, so the served call looks there."""
    path, _, attr = name.rpartition(".")
    try:
        module = root.get_submodule(path) if path else root
    except AttributeError:
        return None
    for slots in (vars(module).get("_parameters"), vars(module).get("_buffers")):
        if isinstance(slots, dict) and slots.get(attr) is tensor:
            return slots, attr
    return None


def written_later(owner: torch.nn.Module | None, target: Any = None) -> Callable[[], bool]:
    """A check of whether a parameter or buffer of ``owner`` (without one: of the modules
    ``target`` reaches, and the tensors it closes over) has been written in place, or replaced
    (``load_state_dict(assign=True)``), since this call (another thread's training step or
    checkpoint swap while a capture is made)."""
    before = _held(owner, target)
    if not before:
        return lambda: False

    def written() -> bool:
        now = _held(owner, target)
        return len(now) != len(before) or any(t is not u or v != w for (t, v), (u, w) in zip(now, before))

    return written


def _held(owner: torch.nn.Module | None, target: Any) -> list[tuple[torch.Tensor, int | None]]:
    tensors = [t for _, t in _named_weights(owner, target)]
    if owner is None and target is not None:
        tensors += [t for _, t in closure_tensors(target)]
    return [(t, _version_of(t)) for t in tensors]


def _named_weights(owner: torch.nn.Module | None, target: Any) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers of ``owner``; without one, of the modules ``target`` reaches (a
    function calling a model it closes over or names)."""
    if owner is not None:
        return [*owner.named_parameters(), *owner.named_buffers()]
    if target is None:
        return []
    return [(f"{where}.{name}", t) for where, module in modules_reached(target, None)
            for name, t in (*module.named_parameters(), *module.named_buffers())]


STILL_CALLS = 2  # calls in a row that find the weights unwritten: they hold still (``Stillness``)


class Stillness:
    """Whether a model's parameters and buffers held still over the last ``STILL_CALLS`` calls that
    asked (``planning.Settle``: a loop that evaluates twice between steps captures nothing the next
    step would drop). The first call that asks finds nothing to compare with."""

    def __init__(self, owner: torch.nn.Module | None, target: Any = None) -> None:
        self.owner, self.target = owner, target
        self.last: Callable[[], bool] | None = None  # written since the last call that asked?
        self.calls = 0

    def held(self) -> bool:
        self.calls = self.calls + 1 if self.last is not None and not self.last() else 0
        self.last = written_later(self.owner, self.target)
        return self.calls >= STILL_CALLS


def _version_of(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _lookup(lookup: Callable[[], Any]) -> Any:
    try:
        return lookup()
    except (AttributeError, KeyError, LookupError, ValueError):  # the attribute or cell is gone
        return None


class Watch:
    """The per-call check over every tensor the live captures baked: ``fresh()`` is True exactly
    when none changed (see the module docstring). Immutable; a new table makes a new watch."""

    def __init__(self, baked: Sequence[Baked]) -> None:
        unique: dict[int, Baked] = {}
        for b in baked:
            unique.setdefault(id(b.tensor), b)
        self.baked = tuple(unique.values())
        versioned = tuple(b.tensor for b in self.baked if b.version is not None)
        versions = sum(b.version for b in self.baked if b.version is not None)
        placed = [b for b in self.baked if b.place is not None]
        loose = [b for b in self.baked if b.place is None]
        rebound = tuple((b.lookup, b.tensor) for b in self.baked if b.rebinds)
        self.fresh: Callable[[], bool] = _fresh_check(
            versioned, versions, tuple(b.tensor for b in loose), tuple(b.pointer for b in loose),
            tuple(b.place[0] for b in placed), tuple(b.place[1] for b in placed), tuple(b.pointer for b in placed),
            _REGISTRATIONS[0], rebound,
        ) if self.baked else _always


def _always() -> bool:
    return True


def _fresh_check(
    versioned: tuple, versions: int, tensors: tuple, pointers: tuple, slots: tuple, names: tuple,
    placed: tuple, registrations: int, rebound: tuple,
) -> Callable[[], bool]:
    """The hot path's check, as one closure over plain data (``unchanged.weights_unchanged``): a
    module's tensors are read from their ``_parameters`` / ``_buffers`` entries, the others
    (closed-over ones) from the objects baked."""
    counter, unchanged, data_ptr = _REGISTRATIONS, weights_unchanged, _data_ptr

    def fresh() -> bool:
        return counter[0] == registrations and unchanged(data_ptr, versioned, versions, slots, names, placed,
                                                         tensors, pointers)

    if not rebound:
        return fresh

    def fresh_and_bound() -> bool:  # closed-over tensors: their cell or global still holds them
        return fresh() and all(_lookup(lookup) is t for lookup, t in rebound)

    return fresh_and_bound


def bake(
    state: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor], owner: torch.nn.Module | None,
    target: Any,
) -> list[Baked]:
    """The tensors an export baked: ``state`` (parameters and buffers, named as in ``owner``) and
    ``constants`` (other tensors the trace read: closed-over ones, plain tensor attributes).

    Each is recorded with where the target finds it now, so a re-registration or a rebinding is
    seen: the owner's attribute path, or the closure cell / global that held it.
    """
    closures = _closure_places(target)
    reached = _reached_tensors(target, owner) if constants else {}
    # torch.export bakes a closed-over Parameter as a tensor of its own over the same memory: found by layout
    laid = {_layout(live): (where, live, lookup) for where, lookup in closures.values()
            if isinstance(live := _lookup(lookup), torch.Tensor)} if constants else {}
    baked = []
    for name, tensor in {**state, **constants}.items():
        lookup = _module_lookup(owner, name) if owner is not None else None
        if lookup is not None and _lookup(lookup) is tensor:
            baked.append(Baked.of(name, tensor, lookup, root=owner))
        elif id(tensor) in closures:
            where, lookup = closures[id(tensor)]
            baked.append(Baked.of(where, tensor, lookup, rebinds=True))
        elif _layout(tensor) in laid:
            where, live, lookup = laid[_layout(tensor)]
            baked.append(Baked.of(where, live, lookup, rebinds=True))
        elif _layout(tensor) in reached:  # the exporter's own tensor over a module's memory: watch the module's
            where, live, lookup = reached[_layout(tensor)]
            baked.append(Baked.of(where, live, lookup, reached=True))
        else:
            baked.append(Baked.of(name, tensor, None))
    return baked


def lent(owner: torch.nn.Module | None) -> list[str]:
    """The parameters of ``owner`` whose slot holds a plain tensor, not a ``Parameter``: tensors
    ``torch.func.functional_call`` lends the module for one call (torch.export refuses them, and
    the graphs of the module's own parameters serve again once they are put back)."""
    if owner is None:
        return []
    return [f"{where}.{name}" if where else name for where, module in owner.named_modules()
            for name, p in vars(module).get("_parameters", {}).items()
            if p is not None and not isinstance(p, torch.nn.Parameter)]


def shared(owner: torch.nn.Module | None, target: Any) -> list[str]:
    """The parameters and buffers (of ``owner``, or of the modules ``target`` reaches) in shared
    memory (``model.share_memory()``, torch.multiprocessing): another process writes them unseen
    by this one's version counters (Hogwild training while this process evaluates)."""
    return [name for name, t in _named_weights(owner, target) if not torch.nn.parameter.is_lazy(t) and t.is_shared()]


def uninitialized(owner: torch.nn.Module | None) -> bool:
    """Whether ``owner`` holds a lazy module's parameters or buffers not made yet (``nn.LazyLinear``
    before its first call, which makes them from the input's sizes)."""
    return owner is not None and any(
        torch.nn.parameter.is_lazy(t) for t in itertools.chain(owner.parameters(), owner.buffers()))


def converted_watch(owner: torch.nn.Module | None, target: Any) -> Callable[[], bool]:
    """A check that is True while no parameter or buffer of ``owner`` (without one: of the modules
    ``target`` reaches), nor a tensor ``target`` closes over, was converted or replaced (``.float()``,
    ``.to()``, a new submodule, a rebound tensor), torch's default dtype is as it was, and (without
    an owner) the reached modules' training flags are: what may make a capture that failed succeed
    (a capture under ``set_default_dtype(torch.float64)`` failed, and the key stayed eager once
    float32 was back; a function calling a model in training mode failed on its dropout, and
    stayed eager after ``model.eval()``: a module target keys its flag, a function's key cannot;
    the flags count only where one was set, so a refusal made in eval mode is not tried again on
    every switch). In-place writes do not count (a training-mode forward writes its buffers on
    every call, and a new value rarely fixes a capture). It reads every tensor's layout on every
    call: for the eager path only (the caller bounds how often it tries again)."""

    # The reached models as they are now (walked once: a rebound variable is the state watch's to see).
    modules = [] if owner is not None else \
        [m for _, reached in modules_reached(target, None) for m in reached.modules()]
    trained = any(m.training for m in modules)  # refused in train mode: a flag back may let it capture

    def layouts() -> tuple:
        tensors = [*owner.parameters(), *owner.buffers()] if owner is not None else \
            [t for m in modules for t in itertools.chain(m.parameters(False), m.buffers(False))]
        return (torch.get_default_dtype(), tuple(m.training for m in modules) if trained else (),
                *map(_layout, tensors + [t for _, t in closure_tensors(target)]))

    before = layouts()
    return lambda: layouts() == before


def _reached_tensors(target: Any, owner: torch.nn.Module | None) -> dict[tuple, tuple[str, torch.Tensor, Any]]:
    """The parameters and buffers of modules the target reaches outside its owner's registered
    tree (a model in a closure, a global, a partial, an object's attribute, a plain list), by
    memory layout: torch.export bakes them as constants of its own that share their memory."""
    found: dict[tuple, tuple[str, torch.Tensor, Any]] = {}
    for where, module in modules_reached(target, owner):
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            found.setdefault(_layout(tensor), (f"{where}.{name}", tensor, _module_lookup(module, name)))
    return found


def _layout(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def found_again(recorded: Sequence[tuple[str, str]], owner: torch.nn.Module | None, target: Any) -> list[Baked] | None:
    """The tensors a graph from the disk cache baked, found by (name, kind) in this process as
    they are now; ``None`` when one cannot be found (its graph cannot be watched: not reused)."""
    baked = []
    reached = dict(modules_reached(target, owner)) if any(k == "reached" for _, k in recorded) else {}
    for name, kind in recorded:
        lookup = _module_lookup(owner, name) if kind == "module" and owner is not None else \
            closure_lookup(target, name) if kind == "closure" else _reached_lookup(reached, name) \
            if kind == "reached" else None
        tensor = _lookup(lookup) if lookup is not None else None
        if not isinstance(tensor, torch.Tensor):
            return None
        baked.append(Baked.of(name, tensor, lookup, rebinds=kind == "closure", reached=kind == "reached",
                              root=owner if kind == "module" else None))
    return baked


def _reached_lookup(reached: dict[str, torch.nn.Module], name: str) -> Callable[[], Any] | None:
    """Where a tensor of a module the target reaches (``model.0.weight``: ``model`` in its closure)
    is found now: the module found at that place, then the tensor's path in it."""
    for where, module in reached.items():
        if name.startswith(where + "."):
            return _module_lookup(module, name[len(where) + 1:])
    return None


def _module_lookup(owner: torch.nn.Module, name: str) -> Callable[[], Any] | None:
    path, _, attr = name.rpartition(".")
    try:
        module = owner.get_submodule(path) if path else owner
    except AttributeError:
        return None
    if not hasattr(module, attr):
        return None
    return lambda: getattr(owner.get_submodule(path) if path else owner, attr)


def needing_grad(target: Any, owner: torch.nn.Module | None) -> list[str]:
    """The names of the tensors a call of ``target`` would bake that require grad: its owner's
    parameters, those of the modules it reaches, and closed-over tensors (a learnable scale)."""
    found = [name for name, p in owner.named_parameters() if p.requires_grad] if owner is not None else []
    for where, module in modules_reached(target, owner):
        found += [f"{where}.{name}" for name, p in module.named_parameters() if p.requires_grad]
    return found + [name for name, t in closure_tensors(target) if t.requires_grad]


def closure_tensors(target: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors the target's function reads from its closure or globals, by variable name."""
    found = []
    for name, lookup in _closure_places(target).values():
        value = _lookup(lookup)
        if isinstance(value, torch.Tensor):
            found.append((name, value))
    return found


def closure_lookup(target: Any, name: str) -> Callable[[], Any] | None:
    """Where the target's function finds the closed-over tensor ``name`` (``None``: nowhere)."""
    return next((lookup for found, lookup in _closure_places(target).values() if found == name), None)


def _closure_places(target: Any) -> dict[int, tuple[str, Callable[[], Any]]]:
    """Tensors the target's function reads from its closure or globals, or (a method of a plain
    object) from its object's attributes: id -> (name, lookup)."""
    fn = getattr(target, "forward", target)
    places: dict[int, tuple[str, Callable[[], Any]]] = {}
    holder = getattr(fn, "__self__", None)
    if holder is not None and not isinstance(holder, torch.nn.Module) and isinstance(getattr(holder, "__dict__", None), dict):
        for name, value in vars(holder).items():  # ``self.w`` of a method's object: rebound like a cell
            if isinstance(value, torch.Tensor):
                places[id(value)] = (f"self.{name}", lambda holder=holder, name=name: getattr(holder, name))
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        value = _cell_value(cell)
        if isinstance(value, torch.Tensor):
            places[id(value)] = (name, lambda cell=cell: cell.cell_contents)
    namespace = getattr(fn, "__globals__", {})
    for name in set(global_names(code)):
        value = namespace.get(name)
        if isinstance(value, torch.Tensor):
            places.setdefault(id(value), (name, lambda name=name: namespace[name]))
    return places


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
