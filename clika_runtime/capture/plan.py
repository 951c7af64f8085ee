"""The values a capture is planned with: the options, one call flattened and split, the plan, and
what captures taught (``Knowledge``). Decisions over them live in ``function.planning``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping, Union

import torch

from clika_runtime.base.specs import TensorSpec
from clika_runtime.guards.guard import SPECIAL_BELOW
from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.calls import CallForms, original_slots
from clika_runtime.trees.key import CallKey, Described, split

_Tensor = torch.Tensor


@dataclass(frozen=True)
class Knowledge:
    """What captures taught about the function, kept across keys until ``reset()``.

    ``learned``: per input name, the axes drift made dynamic (a new key starts with them).
    ``static_axes``: (call form, input, axis) the exporter could not make dynamic at a regular
    size, for calls of that form only (``call_form``: a loss under ``labels=`` is no reason to keep
    the label-free calls' sequence static).
    ``lifted`` / ``unliftable``: per input structure, leaf positions of Python numbers fed to the
    graph, and of numbers the exporter could not lift.
    ``untied``: pairs of (input, axis) seen at different sizes, never again traced as one size.
    """

    learned: Mapping[str, Mapping[int, str | None]] = field(default_factory=lambda: MappingProxyType({}))
    static_axes: frozenset[tuple[str, str, int]] = frozenset()
    lifted: Mapping[Any, frozenset[int]] = field(default_factory=lambda: MappingProxyType({}))
    unliftable: Mapping[Any, frozenset[int]] = field(default_factory=lambda: MappingProxyType({}))
    untied: frozenset[frozenset[tuple[str, int]]] = frozenset()


Axes = Mapping[int, Union[str, None]]  # axis -> dim name (None: named after the input and axis)


@dataclass(frozen=True)
class Options:
    """The compile options that decide what a capture asks of the exporter."""

    signature: tuple[TensorSpec, ...] = ()
    dynamic: bool | None = None
    dynamic_axes: Mapping[str, Axes] = field(default_factory=dict)
    specialize: bool | None = None

    @property
    def shapes_in_key(self) -> bool:
        """``dynamic=False``: each shape set is its own key."""
        return self.dynamic is False


class Call:
    """One call, flattened in its canonical form and split: what a miss decides from.

    ``args`` / ``kwargs`` are the call as the user made it (the target is called with them);
    ``leaves`` and ``structure`` are those of the canonical form (they make the key).
    """

    def __init__(
        self, forms: CallForms, args: tuple, kwargs: dict, owner: torch.nn.Module | None,
        knowledge: Knowledge, options: Options, lifted: frozenset[int] | None = None, made: "Call | None" = None,
    ) -> None:
        self.args, self.kwargs, self._forms, self._options = args, kwargs, forms, options
        if made is None:
            self.canonical = forms(args, kwargs)
            self.leaves, self.structure = trees.flatten(self.canonical)
            # The call as made, before the eager call runs (it may update a KV cache in place): the tracer rebuilds it.
            self.original = (*original_slots(forms, args, kwargs), trees.flatten((args, kwargs))[0])
        else:  # flattened before the eager call, which may have updated a KV cache the call holds since
            self.canonical, self.leaves, self.structure, self.original = made.canonical, made.leaves, made.structure, made.original
            self.__dict__["paths"] = made.paths
        self.lifted = lifted if lifted is not None else _initial_lift(self, knowledge, options)
        self.feeds, statics, metas, self.grad, tensor_at = split(self.leaves, self.lifted, options.shapes_in_key)
        self.key = CallKey(self.structure, statics, metas, owner.training if owner is not None else None, tensor_at)
        self.positions = tuple(i for i, v in enumerate(self.leaves) if isinstance(v, _Tensor) or i in self.lifted)

    def with_lift(self, lifted: frozenset[int], owner: torch.nn.Module | None) -> "Call":
        """The same call with another set of Python numbers fed to the graph."""
        return Call(self._forms, self.args, self.kwargs, owner, Knowledge(), self._options, lifted, made=self)

    @cached_property
    def paths(self) -> tuple[str, ...]:
        """Each canonical leaf's name (``x``, ``batch_input_ids``), before uniquing."""
        names = []
        for path in trees.leaf_paths(self.canonical, self.leaves):
            head = self._forms.argument_name(int(path[1])) if path[0] == "0" else path[1]
            names.append(trees.identifier((head, *path[2:]), "input"))
        return tuple(kvcache.renamed(self.structure, names, kvcache.PAST))  # past_key_values.0.key

    @cached_property
    def names(self) -> tuple[str, ...]:
        """The graph input names: declared signature names, else from the paths; unique."""
        names = [self.paths[p] for p in self.positions]
        declared = [s.name for s in self._options.signature]
        if len(declared) == len(names):
            names = [d or n for d, n in zip(declared, names)]
        return tuple(trees.unique(names))

    @cached_property
    def described(self) -> Described:
        """The key with the names that explain its differences."""
        tensors = tuple(n for n, v in zip(self.names, self.feeds) if isinstance(v, _Tensor))
        statics = tuple(p for p, v in zip(self.paths, self.leaves) if not isinstance(v, _Tensor))
        return Described(self.key, self.paths, statics, tensors)


@dataclass(frozen=True)
class CapturePlan:
    """Capture from this call: the dynamic axes to ask the exporter for, why, and where it goes.

    ``reason`` is ``None`` for the first capture since ``reset()``; ``replaces`` points (weakly: a
    capture the table drops meanwhile must free its session, not wait for this plan) at the
    captures the new one may supersede (those whose calls its guard accepts); ``variant`` marks a graph
    for sizes or a branch side another capture of the key does not serve: it joins the key's
    captures, teaches nothing about the function's dynamic axes, and when it cannot be exported
    dynamic it is exported static, alone.

    An axis whose size in this call is 0 or 1 is exported static unless the user declared it
    dynamic: the exporter treats a dynamic size as "not 1" (broadcasting), so a graph traced from
    a size-1 example with that axis dynamic does not describe the example itself.

    ``ties`` (derived) are the dynamic axes traced as one size: axes the user named alike, and
    axes at the same position of different inputs with equal sizes in this call (``input_ids``
    and ``attention_mask``: models often relate them only through indexing, which the exporter
    cannot see), but for pairs in ``untied`` (seen at different sizes before).
    """

    call: Call
    dynamic: tuple[dict[int, str | None], ...]
    declared: tuple[dict[int, str | None], ...]
    reason: str | None
    replaces: tuple[weakref.ref, ...] = ()  # to Captures (capture.capture, which plans import: not named)
    variant: bool = False
    untied: frozenset[frozenset[tuple[str, int]]] = frozenset()
    spends: bool = True  # counts against config.recapture_limit (see CacheTable.spent)
    point: Any = None  # a variant's sizes (a guards.Verified) beside the graph it is traced for: what a failure refuses
    # A variant's (feed index, axis, lowest, highest) sizes: where the graph it is beside refuses
    # them, so that it never serves sizes that one serves, at which it was not verified.
    bounds: tuple[tuple[int, int, int, int | None], ...] = ()
    ties: tuple[tuple[tuple[int, int], ...], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        exportable = tuple(
            {a: n for a, n in axes.items() if a in declared or not isinstance(value, _Tensor)
             or value.shape[a] >= SPECIAL_BELOW}
            for axes, declared, value in zip(self.dynamic, self.declared, self.call.feeds)
        )
        object.__setattr__(self, "dynamic", exportable)
        object.__setattr__(self, "ties", _ties(self))


def _ties(plan: CapturePlan) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Groups of (feed index, axis) to trace as one size (see ``CapturePlan``)."""
    groups: dict[Any, list[tuple[int, int]]] = {}
    for i, (axes, value) in enumerate(zip(plan.dynamic, plan.call.feeds)):
        if not isinstance(value, _Tensor):
            continue
        for axis, name in axes.items():
            key = ("named", name) if name else ("position", axis, value.shape[axis])
            groups.setdefault(key, []).append((i, axis))
    names = plan.call.names
    ties = []
    for members in groups.values():
        group = [members[0]]
        for i, axis in members[1:]:
            pairs = (frozenset({(names[i], axis), (names[j], b)}) for j, b in group)
            if i not in {j for j, _ in group} and not any(p in plan.untied for p in pairs):
                group.append((i, axis))
        if len(group) > 1:
            ties.append(tuple(group))
    return tuple(ties)


def declared_axes(call: Call, options: Options) -> tuple[dict[int, str | None], ...]:
    """Per fed leaf, the axes the user declared dynamic (signature, ``dynamic_axes``); a lifted
    number is declared dynamic by being lifted."""
    n_tensors = sum(isinstance(t, _Tensor) for t in call.feeds)
    specs = iter(options.signature if len(options.signature) == n_tensors else ())
    declared = []
    for name, value, pos in zip(call.names, call.feeds, call.positions):
        if not isinstance(value, _Tensor):
            declared.append({0: None} if pos in call.lifted else {})
            continue
        axes: dict[int, str | None] = {}
        spec = next(specs, None)
        if spec is not None:
            axes.update({a: d for a, d in enumerate(spec.shape) if not isinstance(d, int)})
        axes.update({a: d for a, d in options.dynamic_axes.get(name, {}).items() if a < value.dim()})
        declared.append(axes)
    return tuple(declared)


def _initial_lift(call: Call, knowledge: Knowledge, options: Options) -> frozenset[int]:
    known = knowledge.lifted.get(call.structure)
    if known is not None:
        return known
    if options.specialize is False:
        unliftable = knowledge.unliftable.get(call.structure, frozenset())
        return frozenset(i for i, v in enumerate(call.leaves) if type(v) is int and i not in unliftable)
    return frozenset()
