"""The Python state a graph baked besides tensors, and the per-call check that it is unchanged.

A trace reads more than tensors: a module's plain attributes (``self.scale``, ``self.config.
output_hidden_states``), which submodules it holds, its forward hooks and a patched ``forward``;
a function's closure cells, the globals its code names, its defaults (``walk.py`` says which).
The graph keeps what they were at capture, so after ``model.config.output_hidden_states = True``,
``model.act = nn.Tanh()`` or ``SCALE = 5.0`` the graph would answer for the old state. A
``Snapshot`` records that state when a capture is made; ``fresh()`` compares it on every served
call; ``changed()`` names what moved, for the re-capture's reason (``compare.py``).

The per-call check is one C-level getter per watched dictionary whose result is compared with
the snapshot (identity first, so an unchanged object is never compared by value), dictionaries'
lengths (an added attribute), and torch's count of hook handles ever made (a hook added anywhere).
Other modules' children are compared when torch's registration counter moves (``weights.py``
watches it) and hooks when the handle count does (then only they are compared when nothing
else moved). Autocast, modes, traces and transforms are not state but the call's circumstances
(``plain_call``): under them calls run eagerly.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from clika_runtime.state.compare import MODULE_PRIVATE, Part, differences, reread, same_untraced, without, word
from clika_runtime.state.reads import Reads, narrowed
from clika_runtime.state.unchanged import state_unchanged
from clika_runtime.state.walk import filled, parts_read


class Snapshot:
    """The state of a target at capture. Immutable; ``fresh()`` is the hot path's check."""

    def __init__(self, parts: list[Part], root: torch.nn.Module | None = None,
                 holders: Mapping[int, Any] | None = None) -> None:
        self.parts = tuple(parts)
        self.root = root
        self.holders = holders or {}  # the objects whose attributes it watches, by their dict's id (walk.py)
        # Captures are keyed by the root's training flag: ``model.train()`` / ``.eval()`` switching
        # every module at once is not a change of state, one submodule switched alone is.
        self.uniform = root is not None and _uniform(root)
        self._own = {id(vars(m)) for m in root.modules()} if root is not None else set()  # the key's modules
        self.fresh: Callable[[], bool] = self.check(_always, modes=False) if self.parts else _always

    def check(self, weights: Callable[[], bool], modes: bool = True) -> Callable[[], bool]:
        """The served call's whole check as one closure: ``weights()`` first, then this state, then
        (``modes``) that the call is plain (``plain_call``)."""
        return _fresh_check(self.parts, weights, _unusual if modes else _never)

    @classmethod
    def of(cls, fn: Any, owner: torch.nn.Module | None, skip: frozenset[tuple[str, str]] = frozenset()) -> "Snapshot":
        """The state ``fn`` (whose weights ``owner`` holds, if a module) reads now, but the
        entries in ``skip`` (``moved()`` pairs: what the target writes itself)."""
        parts, walk = parts_read(fn, owner)
        kept = [without(part, skip) for part in parts] if skip else parts
        return cls([part for part in kept if part is not None], owner, walk.holders)

    def narrowed(self, reads: Reads) -> "Snapshot":
        """The same watch over the names the captures can have read (``reads.py``): an object's
        attributes no capture's code names are left out (a request counter updated between
        calls), private ones named are kept."""
        return Snapshot([narrowed(part, reads, self.holders.get(id(part.container))) for part in self.parts],
                        self.root, self.holders)

    def modes(self) -> frozenset[str]:
        """The modes (``walk.MODE_READERS``) the watched code asks torch for: its modes part's."""
        return frozenset(key.split()[0] for part in self.parts if part.container is torch.autograd for key in part.keys)

    def changed(self) -> list[str]:
        """What differs from the snapshot, in words (empty: nothing a call reads)."""
        switched = self.uniform and _uniform(self.root)  # a whole-model train()/eval(): the key has it
        words = [word(part, key) for part in self.parts for key in differences(part)
                 if not (switched and key == "training" and id(part.container) in self._own)]
        return list(dict.fromkeys(words))  # a container's children are watched twice: said once

    def retriggered(self) -> "Snapshot | None":
        """After torch's count of hook handles moved (a hook made anywhere in the process): the
        same snapshot at the new count when no watched module's hooks or children moved and the
        rest is as it was; ``None`` when something else may have moved (compare everything)."""
        if any(differences(p) for p in self.parts if not p.per_call and not p.trigger):
            return None
        again = Snapshot([reread(p) if p.trigger else p for p in self.parts], self.root, self.holders)
        return again if again.fresh() else None

    def refreshed(self, skip: frozenset[tuple[str, str]] = frozenset()) -> "Snapshot":
        """The same watch over the values as they are now, but the entries in ``skip``: after
        ``changed()`` found nothing a call reads (a hook made and removed elsewhere, an equal
        value re-assigned), or after a capture's eager run wrote ``skip``; without walking the
        target again."""
        parts = [reread(part) for part in self.parts]
        kept = [without(part, skip) for part in parts] if skip else parts
        return Snapshot([part for part in kept if part is not None], self.root, self.holders)

    def without(self, skip: frozenset[tuple[str, str]]) -> "Snapshot":
        """The same watch, values as recorded, but the entries in ``skip``."""
        kept = [without(part, skip) for part in self.parts]
        return Snapshot([part for part in kept if part is not None], self.root, self.holders)

    def moved(self, traced: bool = False) -> frozenset[tuple[str, str]]:
        """The entries that differ from the snapshot, as (part, key) pairs: taken around a call of
        the target, what the target writes itself (``self.last_batch = ...``). An entry that was
        ``None`` is not one: a default the first call fills in (``config.problem_type``) stays
        watched, for the user's own changes (a target that writes it on every call is found
        writing it at its next eager call, which re-captures once). Nor are a module's hooks and
        children: a target that adds them does so once (transformers' output recorders install
        their hooks on the first call that asks for hidden states), and they stay watched from
        what the call left, for the user's own. ``traced``: asked inside a trace, where tensors
        are compared by identity only (``same_untraced``)."""
        same = same_untraced if traced else None
        return frozenset((part.name, key) for part in self.parts for key in differences(part, same)
                         if not (key in part.keys and part.values[part.keys.index(key)] is None)
                         and key not in MODULE_PRIVATE)


    def keeper(self, written: frozenset[tuple[str, str]], hooked: Sequence[Any] = ()) -> Callable[[], None]:
        """What the entries in ``written`` and the containers in ``hooked`` (``hook_containers``)
        hold now (after the target's eager run), and a function that puts back any of them a fake
        tensor has since reached: the export runs the target's Python again over fake tensors, and
        its writes (an append to a global list, ``cache['last'] = y``, ``self.last = x``, a hook's
        ``feats[name] = out``) left them in the user's containers."""
        entries = [(part.container, key, part.container[key]) for part in self.parts
                   if isinstance(part.container, dict) for key in part.keys
                   if (part.name, key) in written and key in part.container]
        holders = [value for _, _, value in entries] + list(hooked)
        contents = [(h, list(h) if type(h) is list else dict(h)) for h in holders if type(h) in (list, dict)]

        def put_back() -> None:
            for container, key, value in entries:
                if container.get(key) is not value and _faked(container.get(key)):  # rebound to a fake
                    container[key] = value
            for holder, saved in contents:
                if _faked(holder):
                    if type(holder) is list:
                        holder[:] = saved
                    else:
                        holder.clear()
                        holder.update(saved)

        return put_back


def hook_containers(root: torch.nn.Module) -> list[tuple[str, Any]]:
    """The dictionaries and lists the forward hooks of ``root``'s modules reach through their
    closures and the globals their code names (one level), each with its hooked module's name:
    where a hook keeps what it saw (feature extraction), which served calls do not run."""
    found: dict[int, tuple[str, Any]] = {}
    for name, module in root.named_modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for hook in hooks.values():
                hook = getattr(hook, "__func__", hook)
                code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
                values = [c.cell_contents for c in cells if filled(c)]
                if code is not None:
                    values += [hook.__globals__[n] for n in code.co_names if n in getattr(hook, "__globals__", {})]
                found.update((id(v), (name or "the model", v)) for v in values if type(v) in (dict, list))
    return list(found.values())


def _faked(value: Any) -> bool:
    """A fake tensor, or a list or dict holding one (at its top level)."""
    from torch._subclasses.fake_tensor import FakeTensor

    items = value if type(value) is list else value.values() if type(value) is dict else (value,)
    return any(isinstance(item, FakeTensor) for item in items)


def _autocast_check() -> Callable[[], bool]:
    """One C call; without it (a torch that renamed it), the public check per device type."""
    private = getattr(torch._C, "_is_any_autocast_enabled", None)
    return private or (lambda: any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))


_any_autocast = _autocast_check()
# torch's private C getters of its mode stacks, tracer and transforms (a torch without one: never).
_function_modes = getattr(torch._C, "_len_torch_function_stack", lambda: 0)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_tracing = getattr(torch._C, "_get_tracing_state", lambda: None)
_transforming = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def _unusual() -> bool:
    """A call a graph cannot answer as eager would: under ``torch.autocast`` (it picks each op's
    dtype), a TorchFunctionMode or TorchDispatchMode (the user's scaling or fake-quant mode, an
    outer ``torch.export``'s tracer, ``FlopCounterMode``: each op is theirs to see or change),
    ``torch.jit.trace`` (it would record the graph's output as a constant) or a ``torch.func``
    transform (``vmap``, ``jvp``: batched or dual tensors). Five C calls, ~0.2 us."""
    return bool(_any_autocast() or (_function_modes() and not _device_contexts_only()) or _dispatch_modes()
                or _tracing() is not None or _transforming() is not None)


def _device_contexts_only() -> bool:
    """The function modes are torch's default-device contexts for CPU or CUDA alone
    (``torch.set_default_device("cuda")`` keeps one for good): the graph's outputs go to its own
    device, and it creates no tensor elsewhere."""
    from torch.utils._device import DeviceContext

    modes = [torch._C._get_function_stack_at(i) for i in range(_function_modes())]
    return all(isinstance(m, DeviceContext) and torch.device(m.device).type in ("cpu", "cuda") for m in modes)


def plain_call() -> bool:
    """No autocast region, mode, trace or transform is active (``_unusual``): a graph may serve."""
    return not _unusual()


def with_modes(weights: Callable[[], bool]) -> Callable[[], bool]:
    """``weights()`` and a plain call: the per-call check of a function with no Python state."""
    return lambda: weights() and not _unusual()


def _always() -> bool:
    return True


def _never() -> bool:
    return False


def _uniform(root: torch.nn.Module) -> bool:
    return len({m.training for m in root.modules()}) == 1


def _fresh_check(parts: tuple[Part, ...], weights: Callable[[], bool], unusual: Callable[[], bool]) -> Callable[[], bool]:
    """One closure over plain data: the weights, torch's hook count and default dtype (read
    inline: the commonest checks, the cheapest way), the lengths, then the watched values, each
    list compared whole."""
    from torch.utils.hooks import RemovableHandle

    unchanged = state_unchanged
    sized = tuple(p.container for p in parts if p.size is not None)
    sizes = tuple(p.size for p in parts if p.size is not None)
    checked = [p for p in parts if p.read is not None and p.per_call]
    readers = tuple(p.read for p in checked)
    read_from = tuple(p.container for p in checked)
    values = tuple(p.values[0] if len(p.keys) == 1 else p.values for p in checked)  # a getter of one key: its value
    # Read inline, by what they watch (torch's other switches are parts of their own: grad mode).
    inline = {p.keys: p.values[0] for p in parts if p.container is RemovableHandle and p.keys == ("next_id",)
              or p.container is torch and p.keys == ("default dtype",)}
    handles, made = RemovableHandle, inline.get(("next_id",), RemovableHandle.next_id)  # as at the snapshot
    default_dtype, dtype = torch.get_default_dtype, inline.get(("default dtype",), torch.get_default_dtype())

    def fresh() -> bool:
        try:
            return (weights() and handles.next_id == made and default_dtype() is dtype
                    and unchanged(sized, sizes, readers, read_from, values) and not unusual())
        except Exception:  # a check that cannot answer: the miss path looks carefully
            return False

    return fresh
