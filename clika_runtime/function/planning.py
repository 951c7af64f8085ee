"""Capture planning: from a call, what the function knows, and its options, to what a miss does.

Pure functions over plain data: nothing here exports, runs a graph or changes a table. A miss is
one of: serve a capture another thread just made, serve eagerly, capture (first, new key, drift,
sizes the graph was not traced for, a branch's other side), or give up (the budget).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union

import torch

from clika_runtime.base.config import config
from clika_runtime.base.errors import SignatureError, SignatureValueError
from clika_runtime.base.specs import TensorSpec
from clika_runtime.capture.plan import Call, CapturePlan, Knowledge, Options, declared_axes
from clika_runtime.function.table import CacheTable
from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.key import Lifted, closest, explain

if TYPE_CHECKING:
    from clika_runtime.capture.value import Capture

_Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Serve:
    """A capture already serves this call (another thread made it meanwhile)."""

    capture: "Capture"


@dataclass(frozen=True)
class Eager:
    """Serve this call eagerly without capturing; ``why`` is said once when set."""

    why: str | None = None


@dataclass(frozen=True)
class GiveUp:
    """The re-capture budget is spent: serve eagerly until ``reset()``."""

    why: str


@dataclass(frozen=True)
class Settle:
    """The re-capture budget is spent by a model whose weights changed before each graph served a
    call (a training loop that evaluates between steps): serve eagerly while they keep changing,
    and capture ``plan`` once they hold still (``weights.Stillness``); ``why`` is said once."""

    plan: CapturePlan
    why: str
    otherwise: GiveUp  # for a target with no module, whose weights have no versions to wait on


Decision = Union[Serve, Eager, CapturePlan, GiveUp, Settle]


def decide(table: CacheTable, call: Call, options: Options, owner: torch.nn.Module | None) -> Decision:
    """What a miss does with ``call``, given everything ``table`` holds."""
    check_signature(call, options)
    if call.grad and torch.is_grad_enabled():
        return Eager()  # the caller is differentiating: stay eager, capture nothing
    variants = table.entries.get(call.key, ())
    for capture in variants:
        if capture.guard.check(call.feeds) is None:
            return Serve(capture)
    if call.key in table.refused or (call.key, EMPTY) in table.refused and _empty(call):
        return Eager()  # its capture failed: said when it did
    if variants:
        return _within_key(table, call, variants, options)
    call, lift_reasons = _lift_changed_numbers(table, call, options, owner)
    if lift_reasons and call.key in table.entries:
        return decide(table, call, options, owner)
    reason = "; ".join(lift_reasons) or table.pending or _key_change(table, call)
    spends = bool(lift_reasons) or (table.pending_spends if table.pending else _a_number_varies(table, call))
    plan = CapturePlan(call, _initial_dynamic(table, call, options), declared_axes(call, options), reason,
                       untied=table.knowledge.untied, spends=spends)
    return _budgeted(table, plan)


@dataclass(frozen=True)
class EmptyCalls:
    """What a key refuses when its first call had a size 0 its graph's kernels cannot run
    (``EmptyKillsError``): its calls with a size 0, not its others."""

    sizes: tuple[tuple[str, int], ...] = (("size", 0),)  # said as "at size=0"


EMPTY = EmptyCalls()


def _empty(call: Call) -> bool:
    return any(0 in feed.shape for feed in call.feeds if isinstance(feed, torch.Tensor))


def _a_number_varies(table: CacheTable, call: Call) -> bool:
    """A new key that differs from a cached one only in the values of baked numbers (a float
    torch.export specialises, an int it cannot lift): spends the budget, unlike a new string,
    structure or dtype, since a number that varies on every call would capture on every call."""
    for capture in table.captures:
        key = capture.key
        if (key.structure, key.tensors, key.tensor_at, key.training) != \
                (call.key.structure, call.key.tensors, call.key.tensor_at, call.key.training):
            continue
        changed = [(a, b) for a, b in zip(key.statics, call.key.statics) if a != b]
        if changed and all(_number(a) and _number(b) for a, b in changed):
            return True
    return False


def _number(static: Any) -> bool:
    return type(static) is tuple and static[:1] in ((int,), (float,))


# Mismatches a variant is traced for, beside the graph: sizes it was not traced for (0/1, past the
# exporter's range) and size branches that flip. The graph computes what its trace took there, and
# one call that agrees with eager says nothing of the next (data on which both sides agree), so
# such sizes get a trace of their own, as torch.compile re-compiles for them.
VARIANT_KINDS = frozenset({"special", "range", "condition", "number"})


def _within_key(table: CacheTable, call: Call, variants: Sequence["Capture"], options: Options) -> Decision:
    """A call whose key is cached but whose sizes no capture of it accepts: trace a variant beside
    the newest capture it only lies outside of (sizes it was not traced for, or sizes the exporter
    pinned on axes it was asked to keep dynamic), else (a static size drifted) re-capture with the
    drifted axes dynamic."""
    found = [(c, c.guard.mismatches(call.feeds)) for c in reversed(variants)]  # newest first
    static = _static_axes(table, call)
    declared = declared_axes(call, options)
    # Sizes a capture was not traced for first: a pinned axis is the rarer reading of a mismatch.
    beside = next(((c, p, False) for c, p in found if {m.kind for m in p} <= VARIANT_KINDS), None) or \
        next(((c, p, True) for c, p in found if _pinned(c, p, call, static)), None)
    if beside is not None:
        capture, problems, pinned = beside
        point = capture.guard.point(call.feeds)
        if (call.key, point) in table.refused:
            return Eager()  # its variant failed: said when it did
        plan = CapturePlan(call, capture.dynamic, declared, _words(problems, pinned), variant=True,
                           untied=table.knowledge.untied, spends=not _small_sizes(problems), point=point,
                           bounds=_outside(found, call))
        return _budgeted(table, plan)
    capture, problems = min(found, key=lambda pair: (sum(p.kind != "size" for p in pair[1]),
                                                     sum(p.kind == "size" for p in pair[1])))
    drifted = [dict(axes) for axes in capture.dynamic]
    for p in problems:
        if p.kind == "size":
            drifted[call.names.index(p.input)].setdefault(p.axis, None)
    dynamic = tuple(_without_static(static, d, n) for d, n in zip(drifted, call.names))
    reasons = [_drift(p) if p.kind == "size" else str(p) for p in problems]
    untied = table.knowledge.untied | _split(capture, problems, call)
    plan = CapturePlan(call, dynamic, declared, "; ".join(reasons), replaces=tuple(map(weakref.ref, variants)),
                       untied=untied, spends=not _from_small_sizes(problems))
    return _budgeted(table, plan)


def _outside(found: Sequence[tuple["Capture", Sequence[Any]]],
             call: Call) -> tuple[tuple[int, int, int, int | None], ...]:
    """A variant's bounds (``CapturePlan.bounds``): on each axis whose size lies outside the
    range of a graph of its key, the sizes on that side of the range (of every such graph)."""
    bounds = []
    for capture, problems in found:
        for p in problems:
            if p.kind != "range":
                continue
            index = call.names.index(p.input)
            lo, hi = capture.guard.bounds(capture.guard.inputs[index].shape[p.axis])
            bounds.append((index, p.axis, 0, lo - 1) if p.got < lo else (index, p.axis, hi + 1, None))
    return tuple(bounds)


def _words(problems: Sequence[Any], pinned: bool = False) -> str:
    """The first few mismatches in words (a Swin window's conditions come by the dozen)."""
    if pinned:
        return "; ".join(f"{_drift(p)} (an axis the exporter traces at one size only: a graph for this size beside "
                         "the others)" for p in problems)
    text = "; ".join(str(p) for p in problems[:3])
    return text + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")


def _drift(problem: Any) -> str:
    return f"shape drift: input '{problem.input}' axis {problem.axis}: {problem.expected} -> {problem.got}"


def _pinned(capture: "Capture", problems: Sequence[Any], call: Call, static: set[tuple[str, int]]) -> bool:
    """Whether a call lies outside a capture only by sizes on axes the capture asked the exporter
    to keep dynamic and it traced static (torch.export specialises a sequence an RNN or a Python
    loop walks, and a size a branch compares), or that an export could not make dynamic
    (``static``: a loss whose ``ignore_index`` is the length): another re-capture would pin it
    again, so each size gets a variant of its own, beside the others, as torch.compile
    re-compiles per size."""
    sized = [p for p in problems if p.kind == "size"]
    return len(sized) == len(problems) > 0 and all(
        p.axis in capture.dynamic[call.names.index(p.input)] or (p.input, p.axis) in static for p in sized)


def _from_small_sizes(problems: Sequence[Any]) -> bool:
    """Whether a call drifts only from sizes 0/1 a graph was traced static at (torch.export
    specialises them: a key first called at batch 1): the graph that makes those axes dynamic is
    the key's second step, no waste, and comes once per axis, so it spends no budget."""
    return bool(problems) and all(p.kind == "size" and isinstance(p.expected, int) and p.expected < 2
                                  for p in problems)


def _small_sizes(problems: Sequence[Any]) -> bool:
    """Whether a call lies outside a graph only by sizes 0/1 (and the conditions they flip): the
    variant traced for them is no waste, and there are few (two sizes per axis), so it spends no
    budget, as a new key does not."""
    sized = [p for p in problems if p.kind in ("special", "range")]
    return bool(sized) and all(p.got < 2 for p in sized)


def _split(capture: "Capture", problems: Sequence[Any], call: Call) -> frozenset[frozenset[tuple[str, int]]]:
    """Axes a capture traced as one size that this call gives different sizes: never tie them again."""
    pairs = set()
    for p in problems:
        if p.kind == "equal":
            dim = capture.guard.inputs[call.names.index(p.input)].shape[p.axis]
            first = next((r.name, r.shape.index(dim)) for r in capture.guard.inputs if r.shape and dim in r.shape)
            pairs.add(frozenset({first, (p.input, p.axis)}))
    return frozenset(pairs)


def _budgeted(table: CacheTable, plan: CapturePlan) -> Decision:
    limit = config.recapture_limit
    if plan.reason is not None and len(table.spent) >= limit:  # past that much waste, every re-capture stops
        if plan.variant:  # the key's graphs keep serving the sizes they were traced for, as torch.compile's
            return Eager(f"re-capture limit ({limit}) reached: calls at sizes no graph of their key was traced "
                         f"for run eagerly, the others are served (spent by {_spent(table.spent)})")
        hint = ("; a number that varies between calls feeds the graph when passed as a tensor "
                "(torch.tensor(value))") if plan.spends and plan.reason.startswith("static value changed") else ""
        given_up = GiveUp(f"re-capture limit ({limit}) reached; last: {plan.reason}{hint}; "
                          f"spent by {_spent(table.spent)}")
        if _moving(plan.reason, table.spent):
            return Settle(plan, f"re-capture limit ({limit}) reached by weights that change between calls (spent by "
                                f"{_spent(table.spent)}): calls run eagerly while they do, and capture once they "
                                "hold still over two calls in a row", given_up)
        return given_up
    return plan


# Kinds of re-capture whose cause is a model that changes between calls (a training loop): past the
# budget they wait for still weights (``Settle``) instead of giving up for good.
_MOVING = ("weights changed", "model changed while capturing")


def _moving(reason: str, spent: Sequence[str]) -> bool:
    """Whether the model changing between calls is what spent the budget: this re-capture's
    reason, or most of what spent it (a shape drift may take the last unit)."""
    kinds = [r.split(":")[0] for r in spent]
    return reason.split(":")[0] in _MOVING or sum(k in _MOVING for k in kinds) * 2 > len(kinds)


# Kinds of re-capture that spend the budget only when the graph they replace served no call (table.without).
_UNSERVED = {"weights changed", "state changed"}


def _spent(spent: Sequence[str]) -> str:
    """What spent the budget, by kind, most first: ``5 shape drift, 3 weights changed ...``."""
    kinds: dict[str, int] = {}
    for reason in spent:
        kind = reason.split(":")[0]
        if kind.count("(") > kind.count(")"):  # "the graph failed on these inputs (Error in execution"
            kind = kind[:kind.index(" (")]
        kind += " before its graph served a call" if kind in _UNSERVED else ""
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda item: -item[1]))


def _key_change(table: CacheTable, call: Call) -> str | None:
    """Why a call with a new key re-captures (``None``: the first capture since ``reset()``)."""
    candidates = [c.described for c in table.captures] or ([table.last] if table.last is not None else [])
    nearest = closest(candidates, call.key)
    return None if nearest is None else explain(nearest, call.described)


# ------------------------------------------------------------------------------------- dynamic axes


def _initial_dynamic(table: CacheTable, call: Call, options: Options) -> tuple[dict[int, str | None], ...]:
    """Dynamic axes of a new key's first capture: declared ones; with ``dynamic=True`` every
    axis; with ``dynamic=None`` those drift taught about the same input name."""
    dynamic = []
    learned = table.knowledge.learned
    static = _static_axes(table, call)
    for name, value, declared in zip(call.names, call.feeds, declared_axes(call, options)):
        axes: dict[int, str | None] = {}
        if isinstance(value, _Tensor) and options.dynamic is True:
            axes = {a: None for a in range(value.dim())}
        elif isinstance(value, _Tensor) and options.dynamic is None:
            axes = {a: n for a, n in learned.get(name, {}).items() if a < value.dim()}
        dynamic.append(_without_static(static, {**axes, **declared}, name))
    return tuple(dynamic)


def _without_static(static: set[tuple[str, int]], axes: Mapping[int, Any], name: str) -> dict:
    """Drop axes the exporter could not make dynamic before for calls of this form (``static``:
    ``_static_axes``: declared ones too, which are there only when their graph was wrong at other
    sizes, ``declared_static``)."""
    return {a: n for a, n in axes.items() if (name, a) not in static}


def _static_axes(table: CacheTable, call: Call) -> set[tuple[str, int]]:
    """The (input, axis) pairs the exporter could not make dynamic for calls of ``call``'s form."""
    form = call_form(call)
    return {(name, axis) for f, name, axis in table.knowledge.static_axes if f == form}


def call_form(call: Call) -> str:
    """A call's structure, static values and mode, without its sizes, as a digest that reads the
    same in another process: what keeps an axis static is the code a call of that form runs."""
    key = call.key
    return hashlib.sha256(f"{key.structure}|{key.statics!r}|{key.tensor_at}|{key.training}".encode()).hexdigest()[:16]


def variant_static(plan: CapturePlan) -> CapturePlan | None:
    """A variant that failed dynamic: the same with only declared axes dynamic (``None`` when
    nothing else was asked)."""
    if all(set(axes) <= set(declared) for axes, declared in zip(plan.dynamic, plan.declared)):
        return None
    return replace(plan, dynamic=tuple(dict(k) for k in plan.declared))


def learned_static(plan: CapturePlan) -> tuple[CapturePlan, list[tuple[str, int]]] | None:
    """A capture that failed with learned dynamic axes: the same with only declared axes dynamic,
    and the axes given up (the function keeps them static from now on)."""
    given_up = [(n, a) for n, d, k in zip(plan.call.names, plan.dynamic, plan.declared) for a in d if a not in k]
    if not given_up:
        return None
    return replace(plan, dynamic=tuple(dict(k) for k in plan.declared)), given_up


def declared_static(plan: CapturePlan) -> tuple[CapturePlan, list[tuple[str, int]]] | None:
    """A capture whose declared dynamic axes gave a graph wrong at other sizes (torch.export baked a
    size computed from them): the same with every axis static, and the declared axes given up
    (the function keeps them static from now on: a graph per size)."""
    given_up = [(n, a) for n, d in zip(plan.call.names, plan.dynamic) for a in d]
    if not given_up:
        return None
    return replace(plan, dynamic=tuple({} for _ in plan.dynamic)), given_up


def learned(
    knowledge: Knowledge, plan: CapturePlan, options: Options, *, static_axes: Sequence[tuple[str, int]] = (),
    unliftable: frozenset[int] = frozenset(),
) -> Knowledge:
    """What a successful capture teaches: its dynamic axes by input name, its lifted numbers, and
    what its retries gave up (axes exported static, numbers the exporter could not lift)."""
    learned_axes = dict(knowledge.learned)
    if options.dynamic is None and not plan.variant:
        for name, value, axes in zip(plan.call.names, plan.call.feeds, plan.dynamic):
            if isinstance(value, _Tensor):
                learned_axes[name] = MappingProxyType(dict(axes))
    structure = plan.call.structure
    lifted = dict(knowledge.lifted)
    if plan.call.lifted:
        lifted[structure] = plan.call.lifted
    else:
        lifted.pop(structure, None)
    never = dict(knowledge.unliftable)
    if unliftable:
        never[structure] = never.get(structure, frozenset()) | unliftable
    return Knowledge(
        learned=MappingProxyType(learned_axes),
        static_axes=knowledge.static_axes | {(call_form(plan.call), name, axis) for name, axis in static_axes},
        lifted=MappingProxyType(lifted), unliftable=MappingProxyType(never), untied=knowledge.untied | plan.untied,
    )


# ------------------------------------------------------------------------------------------ numbers


def _lift_changed_numbers(
    table: CacheTable, call: Call, options: Options, owner: torch.nn.Module | None
) -> tuple[Call, list[str]]:
    """``specialize=None``: ints whose value changed against a capture of the same structure
    become graph inputs (floats stay baked: torch.export specialises Python floats)."""
    if options.specialize is not None:
        return call, []
    same = [c for c in table.captures if c.key.structure == call.key.structure and c.key.tensors == call.key.tensors
            and c.key.tensor_at == call.key.tensor_at and c.key.training == call.key.training]
    if not same:
        return call, []
    old = same[-1]
    unliftable = table.knowledge.unliftable.get(call.structure, frozenset())
    statics = [i for i, v in enumerate(call.leaves) if not isinstance(v, _Tensor)]
    changed = []
    for i, name, before, now in zip(statics, call.described.static_names, old.key.statics, call.key.statics):
        if before == now or i in call.lifted or i in unliftable or isinstance(before, Lifted):
            continue
        if type(call.leaves[i]) is int and before[0] is int:
            changed.append((i, name, before[1], call.leaves[i]))
    if not changed:
        return call, []
    reasons = [f"static value changed: '{n}' {a} -> {b}; it becomes a graph input" for _, n, a, b in changed]
    return call.with_lift(call.lifted | {i for i, *_ in changed}, owner), reasons


def unlifted(plan: CapturePlan, owner: torch.nn.Module | None) -> tuple[CapturePlan, list[str]] | None:
    """A capture that failed with lifted numbers: the same with every number baked, and the
    names of the numbers given up (``None`` when nothing was lifted)."""
    call = plan.call
    if not call.lifted:
        return None
    names = [n for n, p in zip(call.names, call.positions) if p in call.lifted]
    tensors = [isinstance(v, _Tensor) for v in call.feeds]
    dynamic = tuple(dict(axes) for axes, keep in zip(plan.dynamic, tensors) if keep)
    declared = tuple(dict(axes) for axes, keep in zip(plan.declared, tensors) if keep)
    return replace(plan, call=call.with_lift(frozenset(), owner), dynamic=dynamic, declared=declared), names


# ---------------------------------------------------------------------------------------- signature


def check_signature(call: Call, options: Options) -> None:
    """A call that breaks the declared signature or declared dim names raises before anything runs."""
    tensors = [(n, t) for n, t in zip(call.names, call.feeds) if isinstance(t, _Tensor)]
    declared: list[tuple[str, int, str]] = []  # (input, axis, dim name) declared by name
    if options.signature:
        declared += _check_specs(tensors, options.signature)
    shapes = dict(tensors)
    for name, axes in options.dynamic_axes.items():
        if name in shapes:
            declared += [(name, a, d) for a, d in axes.items() if d and a < shapes[name].dim()]
    first: dict[str, tuple[str, int, int]] = {}
    for name, axis, dim in declared:
        size = shapes[name].shape[axis]
        seen = first.setdefault(dim, (name, axis, size))
        if seen[2] != size:
            raise SignatureValueError(
                f"input '{name}' axis {axis}: dim '{dim}' is {size}, but input '{seen[0]}' axis {seen[1]} "
                f"gave it {seen[2]} (equal dim names mean equal sizes)"
            )


def _check_specs(tensors: list[tuple[str, _Tensor]], signature: Sequence[TensorSpec]) -> list[tuple[str, int, str]]:
    if len(tensors) != len(signature):
        raise SignatureError(
            f"signature declares {len(signature)} tensor inputs, the call has {len(tensors)}: {[n for n, _ in tensors]}"
        )
    named = []
    for (name, t), spec in zip(tensors, signature):
        if spec.dtype is not None and t.dtype != spec.dtype:
            raise SignatureError(f"input '{name}': expected dtype {spec.dtype}, got {t.dtype}")
        if t.dim() != len(spec.shape):
            raise SignatureError(f"input '{name}': expected rank {len(spec.shape)} {list(spec.shape)}, got shape {tuple(t.shape)}")
        for axis, (want, got) in enumerate(zip(spec.shape, t.shape)):
            if isinstance(want, int) and want != got:
                raise SignatureValueError(f"input '{name}' axis {axis}: expected size {want} {list(spec.shape)}, got {got}")
        named += [(name, a, d) for a, d in enumerate(spec.shape) if isinstance(d, str)]
    return named


def planned(plan: CapturePlan, eager_out: Any, options: Options) -> CapturePlan:
    """The capture plan of a decoder step (a call whose output holds a cache) with its sequence
    axes dynamic (see ``trees.kvcache``'s docstring); any other plan as it is. Variants (graphs for sizes
    0/1 or a branch side) and ``dynamic=False`` are left alone."""
    if plan.variant or options.dynamic is False or not kvcache.adapting():
        return plan
    out_leaves, out_structure = trees.flatten(eager_out)
    present = kvcache.cache_leaves(out_structure)
    if not present:
        return plan
    lengths: dict[bool, int] = {}  # the output caches' lengths: the decoder's (False), the encoder's (True)
    for i, slot in present.items():
        cross = slot.part == kvcache.ENCODER
        lengths[cross] = max(lengths.get(cross, 0), out_leaves[i].shape[kvcache.SEQUENCE_AXIS])
    length, encoder_length = lengths.get(False), lengths.get(True)
    call = plan.call
    past = kvcache.cache_leaves(call.structure)
    name = kvcache.TOTAL_DIM if past else kvcache.SEQUENCE_DIM
    dynamic, asked = [], []
    for position, value, axes, declared in zip(call.positions, call.feeds, plan.dynamic, plan.declared):
        shape = getattr(value, "shape", None)
        wanted: dict[int, str] = {}
        ask: dict[int, str | None] = {}
        if shape is None:
            pass
        elif position in past:
            cross = past[position].part == kvcache.ENCODER
            wanted[kvcache.SEQUENCE_AXIS] = kvcache.ENCODER_DIM if cross else kvcache.PAST_DIM
            if not cross:
                # A past of 1 (the first step after a one-token start: every encoder-decoder's
                # generate) is asked dynamic as a declared axis would be: traced for [2, inf) and
                # verified at 1 by the capture itself, instead of a static graph superseded at 2.
                ask = {kvcache.SEQUENCE_AXIS: declared.get(kvcache.SEQUENCE_AXIS, kvcache.PAST_DIM)}
        else:
            # The encoder's length (an encoder-decoder's cross-attention cache), then the decoder's:
            # where the two are equal the decoder's name wins, and a later call where they differ
            # re-captures with them apart (the guard holds the graph to what it was traced for).
            for size, dim in ((encoder_length, kvcache.ENCODER_DIM), (length, name)):
                if len(shape) == 1 and shape[0] == size:
                    wanted[0] = dim
                else:
                    wanted.update({a: dim for a in range(1, len(shape)) if shape[a] == size})
        # Axes the user declared keep the user's names.
        dynamic.append({**axes, **{a: n for a, n in wanted.items() if a not in declared}})
        asked.append({**declared, **ask})
    return replace(plan, dynamic=tuple(dynamic), declared=tuple(asked))
