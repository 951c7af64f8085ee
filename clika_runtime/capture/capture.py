"""One capture: export the target from a call, open its session, verify it against eager.

``build`` turns a ``CapturePlan`` and the eager result of its call into a ``Capture``, or raises
``CaptureError`` saying why: any failure on the way (exporter, graph edits, onnxruntime, runner,
verification) is a capture failure, so the caller always keeps the eager result it is owed.
The value is ``capture.value``; opening and verifying a written graph is ``capture.assembly``
(shared with the disk cache); how a capture serves calls, ``capture.closures``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import optree
import torch

import exporters
import serving
from clika_runtime.base.config import config
from clika_runtime.base.errors import CaptureError, EmptyKillsError, SecondSizeError, UncapturableError, first_line
from clika_runtime.base.precision import FP32, Agreement, refusal
from clika_runtime.base.specs import TensorInfo
from clika_runtime.base.version import VERSION
from clika_runtime.capture import fusing, hints, reducing
from clika_runtime.capture.assembly import Made, assemble
from clika_runtime.capture.plan import CapturePlan
from clika_runtime.capture.value import Capture, examples
from clika_runtime.capture.verify import first_mismatch
from clika_runtime.format import metadata, treedesc
from clika_runtime.guards import json_form as guards
from clika_runtime.guards.conditions import evaluate
from clika_runtime.guards.guard import Guard, InputRule, dtype_name
from clika_runtime.shipped.folder import EXTERNAL_ABOVE, GraphFolder
from clika_runtime.state.weights import bake
from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.calls import CallForms

_SCALARS = {int: "int", float: "float", bool: "bool"}


_monotonic = time.monotonic
logger = logging.getLogger("clika_runtime")


def build(
    plan: CapturePlan, eager_out: Any, *, target: Callable[..., Any], forms: CallForms, owner: torch.nn.Module | None,
    output_names: Sequence[str] | None, output_axes: dict[str, dict[int, str | None]], graph_name: str,
    optimize: bool, place: serving.Place, parameters: Sequence[str],
    exporting: Callable[[], ContextManager[Any]] = contextlib.nullcontext, work_dir: str | None = None,
    precision: str = FP32, agreement: Agreement = Agreement(), elsewhere: bool = False,
    on_trace: Callable[[], None] | None = None, parked: Callable[[int], bool] | None = None,
) -> Capture:
    """Export, write the graph to a folder (under ``work_dir``), open a session and verify.
    Raises ``CaptureError`` (``VerificationError``) with why. ``elsewhere``: a graph with dynamic
    axes is verified at a second size too (``second_size``), which runs the target once more
    (the caller says when that is safe: no state it writes, no hooks that keep what they see).

    ``exporting`` is held around the export: the target must not run eagerly meanwhile; ``parked``
    says which threads wait for it (``exporters.export_graph``).
    ``precision``: a reduced one (``int8``, ``fp16``) serves when its graph meets ``agreement``
    with eager; else the fp32 graph serves and ``Capture.precision_note`` says why.
    ``on_trace`` is called each time the export has run the target's Python, as it returns: what
    the trace wrote is still in place then (the exporter puts module attributes back after).
    """
    try:
        with torch.inference_mode(False), torch.no_grad():
            capture = _build(plan, eager_out, target, forms, owner, output_names, output_axes, graph_name, optimize,
                             place, parameters, exporting, work_dir, precision, agreement, on_trace, parked)
            if elsewhere and capture.precision is None:
                second_size(capture, plan, _tracer(plan, target, forms),
                            output_names_of(eager_out, trees.flatten(eager_out)[0], output_names, plan.call.names))
            return capture
    except CaptureError:
        raise
    except Exception as e:  # anything else on the way is a capture failure too, never a lost call
        raise CaptureError(f"{type(e).__name__} while capturing: {first_line(e)}") from e


def _build(
    plan: CapturePlan, eager_out: Any, target: Callable[..., Any], forms: CallForms, owner: torch.nn.Module | None,
    output_names: Sequence[str] | None, output_axes: dict, graph_name: str, optimize: bool, place: serving.Place,
    parameters: Sequence[str], exporting: Callable[[], ContextManager[Any]], work_dir: str | None,
    precision: str, agreement: Agreement, on_trace: Callable[[], None] | None, parked: Callable[[int], bool] | None,
) -> Capture:
    phases: dict[str, float] = {}
    call = plan.call
    trees.adopt(eager_out)  # a dataclass of tensors returned: a node, as it is passed in
    eager_leaves, out_spec = trees.flatten(eager_out)
    hints.check_inputs(call.feeds, call.names)
    hints.check_outputs(eager_leaves)
    names = output_names_of(eager_out, eager_leaves, output_names, call.names)
    trace = _tracer(plan, target, forms, on_trace)
    started = time.perf_counter()
    with exporting():  # also while looking up the baked tensors: no other export swaps them for fakes
        exported = _export(plan, trace, names, eager_leaves, graph_name, output_axes, optimize, owner,
                           guard_nan=place.device == "cpu", parked=parked)
        baked = tuple(bake(exported.state, exported.constants_read, owner, target))
    phases["export"] = time.perf_counter() - started
    _refuse_killing_ops(exported, call.feeds)
    guard = _guard(plan, exported, list(call.feeds), place)
    scalar_out = {pos: type(eager_leaves[pos]) for pos in exported.graph_leaves if type(eager_leaves[pos]) in _SCALARS}
    metadata_entries = _metadata(plan, exported, out_spec, eager_leaves, scalar_out, guard, parameters)
    outputs = tuple(TensorInfo(*o) for o in exporters.outputs(exported))
    started = time.perf_counter()
    folder = GraphFolder(work_dir)
    exporters.save(exported, str(folder.model), metadata_entries, EXTERNAL_ABOVE)
    phases["save"] = time.perf_counter() - started
    if optimize:
        started = time.perf_counter()
        fusing.fuse(exported, folder, place)
        if exporters.model_bytes(exported) < fusing.MEASURED_BELOW:
            fusing.keep_if_faster(folder, place, call.names, call.feeds, config.session_threads())
        phases["fuse"] = time.perf_counter() - started
    note = refusal(precision, place.device) if precision != FP32 else None
    if precision != FP32 and note is None:
        started = time.perf_counter()
        note = reducing.reduce(folder, precision)
        phases[precision] = time.perf_counter() - started
    made = Made(plan, eager_out, folder, guard, list(exported.graph_leaves), dict(exported.constants), scalar_out,
                names, baked, outputs, phases, precision, agreement,
                None if note is None else f"{precision} not served, {_unreduced(eager_out)} serves instead: {note}")
    return assemble(made, place, optimize, owner, keep_optimized=work_dir is not None)


def _refuse_killing_ops(exported: Any, feeds: Sequence[Any]) -> None:
    """Raise ``EmptyKillsError`` (no other export helps) before a graph runs on inputs with a
    size 0 that onnxruntime's kernels would kill the process on (``serving.KILLED_BY_EMPTY``):
    such calls run eagerly (a variant's sizes, beside a graph that serves the key's others; the
    key's calls with a size 0 when its first call is an empty one)."""
    if not any(isinstance(f, torch.Tensor) and 0 in f.shape for f in feeds):
        return
    killing = sorted(serving.KILLED_BY_EMPTY & {node.op_type for node in exported.model.graph.all_nodes()})
    if killing:
        raise EmptyKillsError(f"onnxruntime's {killing[0]} kills the process on an empty input, and this call "
                                "has a size 0: such calls run eagerly")


def _unreduced(eager_out: Any) -> str:
    """The graph that serves where the precision asked for does not, by its outputs' float dtype."""
    leaves = trees.flatten(eager_out)[0]
    dtypes = {leaf.dtype for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
    other = sorted(str(d).replace("torch.", "") for d in dtypes - {torch.float32})
    return f"the {other[0]} graph" if other and len(dtypes) == 1 else "fp32"


def second_size(capture: Capture, plan: CapturePlan, trace: Callable[..., list[Any]], names: Sequence[str]) -> None:
    """Raise ``SecondSizeError`` where the graph disagrees with eager at other sizes, where the
    guard accepts them and the target answers: each dynamic axis of at least 3 one shorter (or
    longer where one is 2), then each as much longer as the longest is long, up to 64 more
    (``_elsewhere``). torch.export bakes a size computed in Python floats (``int(n * 0.7)``,
    interpolate's ``area`` length, an output of length 1) as its value at the traced size,
    leaving the axis dynamic: the one verified size could not show it."""
    feeds = list(plan.call.feeds)
    for other in _elsewhere(feeds, plan.dynamic):
        if all(s is f for s, f in zip(other, feeds)) or capture.guard.mismatches(examples(other)):
            continue
        try:
            eager_leaves = trace(*other)
        except Exception:  # the target does not take these sizes: nothing to judge by
            continue
        try:
            served = trees.flatten(capture.run(other))[0]
        except Exception as e:
            raise SecondSizeError(f"the graph failed at a second size ({_sizes(other)}): {first_line(e)}") from e
        finally:
            capture.stats.hits = 0  # the verification run served no call
        problem = first_mismatch(list(names), eager_leaves, served)
        if problem:
            raise SecondSizeError(f"the graph disagrees with eager at a second size ({_sizes(other)}): {problem}")


_LONGER = 3
_FARTHER = 64  # the farthest second size looks, past the call's (its cost: one eager call that long)


def _elsewhere(feeds: Sequence[Any], dynamic: Sequence[Mapping[int, Any]]) -> list[list[Any]]:
    """The feeds at other sizes: every dynamic axis of at least 3 one shorter, or, where one of
    them is 2 (shorter is a size the trace assumes away), every one of at least 2 three longer,
    its last slice repeated (at 3, an output of length 1 and its edge cases would still look
    alike); then every one as much longer as the longest is long, up to ``_FARTHER`` (a baked
    ``int(n * 0.7)`` is 2 at both 4 and 3, not at 8). One step the same way for all keeps the
    axes that are one size, or one more than another, so."""
    sizes = [feed.shape[axis] for feed, axes in zip(feeds, dynamic) if isinstance(feed, torch.Tensor) for axis in axes]
    near = _LONGER if 2 in sizes else -1
    far = max(_LONGER, min(max(sizes, default=0), _FARTHER))
    return [[_stepped(feed, axes, step) if isinstance(feed, torch.Tensor) else feed
             for feed, axes in zip(feeds, dynamic)] for step in dict.fromkeys((near, far))]


def _stepped(feed: torch.Tensor, axes: Mapping[int, Any], step: int) -> torch.Tensor:
    stepped = feed
    for axis in axes:
        size = feed.shape[axis]
        if size < 2:
            continue
        if step < 0:
            stepped = stepped.narrow(axis, 0, size - 1)
        else:
            stepped = torch.cat([stepped] + [stepped.narrow(axis, size - 1, 1)] * step, axis)
    return stepped if stepped is feed else stepped.contiguous()


def _sizes(feeds: Sequence[Any]) -> str:
    return ", ".join(str(tuple(f.shape)) for f in feeds if isinstance(f, torch.Tensor))


def _tracer(plan: CapturePlan, target: Callable[..., Any], forms: CallForms,
            returned: Callable[[], None] | None = None) -> Callable[..., list[Any]]:
    """The target as a function of the fed leaves, called exactly as the user called it;
    ``returned()`` after each call."""
    call = plan.call
    structure, slots, original = call.original  # as the call was made: the eager call may have changed it (a KV cache)
    into = [slots[p] for p in call.positions]
    same = [(first, other) for group in plan.ties for first, other in zip(group, group[1:])]

    def flat(*feeds: Any) -> list[Any]:
        for (i, a), (j, b) in same:  # tell the tracer these sizes are one (see CapturePlan.ties)
            torch._check(feeds[i].shape[a] == feeds[j].shape[b])
        leaves = list(original)
        for index, value in zip(into, feeds):
            if index is not None:
                leaves[index] = value
        args, kwargs = structure.unflatten(leaves)
        out = trees.flatten(target(*args, **kwargs))[0]
        if returned is not None:
            returned()
        return out

    return flat


def output_names_of(eager_out: Any, eager_leaves: list[Any], given: Sequence[str] | None,
                    inputs: Sequence[str]) -> list[str]:
    """A name per output leaf: the user's ``output_names`` for the leaves a graph computes, else
    names from the output pytree's keys and paths, with ``_out`` added where one would be an
    input's name (``return {"x": x + 1}``: ONNX names each value once)."""
    defaults = kvcache.renamed(trees.flatten(eager_out)[1], trees.output_names(eager_out, eager_leaves), kvcache.PRESENT)
    taken = set(inputs)
    defaults = [_free(name, taken) for name in defaults]
    if given is None:
        return trees.unique(defaults)
    computed = [i for i, leaf in enumerate(eager_leaves) if isinstance(leaf, (torch.Tensor, int, float))]
    if len(given) != len(computed):
        raise CaptureError(
            f"output_names: expected {len(computed)} names (one per computed output leaf: "
            f"{[defaults[i] for i in computed]}), got {len(given)}: {list(given)}"
        )
    clashing = sorted(taken.intersection(given))
    if clashing:
        raise CaptureError(f"output_names: {clashing} already name graph inputs (the inputs are {list(inputs)}); "
                           "ONNX names each value once: pick other names")
    names = list(defaults)
    for i, name in zip(computed, given):
        names[i] = name
    return trees.unique(names)


def _free(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_out"
    return name


def _export(
    plan: CapturePlan, trace: Callable[..., list[Any]], names: list[str], eager_leaves: list[Any], graph_name: str,
    output_axes: dict, optimize: bool, owner: torch.nn.Module | None, guard_nan: bool,
    parked: Callable[[int], bool] | None,
) -> exporters.ExportedGraph:
    call = plan.call
    dynamic = [dict(d) for d in plan.dynamic]

    def export() -> exporters.ExportedGraph:
        try:
            return exporters.export_graph(
                trace, _distinct(call.feeds), input_names=list(call.names), output_names=names,
                output_dtypes=[_output_dtype(leaf) for leaf in eager_leaves],
                dynamic=dynamic, graph_name=graph_name, output_dims=output_axes, optimize=optimize, owner=owner,
                guard_nan=guard_nan, parked=parked,
            )
        except exporters.Uncapturable as e:
            raise UncapturableError(str(e)) from e
        except RuntimeError as e:
            raise CaptureError(f"the exporter failed: {hints.exporter_failure(e)}") from e

    exported = export()
    opaque = {(i, a) for i, a in exported.opaque if a is not None}
    if opaque:  # branches on sizes the guard cannot re-check: export those axes static instead
        dynamic = [{a: n for a, n in d.items() if (i, a) not in opaque} for i, d in enumerate(dynamic)]
        exported = export()
    lifted = {i for i, p in enumerate(call.positions) if p in call.lifted}
    unliftable = set(exported.specialized) | {i for i, a in exported.opaque if a is None}
    baked = [call.names[i] for i in sorted(unliftable & lifted)]
    if baked:
        raise CaptureError(f"the exporter specialised number input(s) {baked} to their example values")
    if not exported.graph_leaves:
        raise CaptureError("the function returns no tensor: there is nothing for a graph to compute")
    return exported


def _distinct(feeds: Sequence[Any]) -> list[Any]:
    """The feeds with each tensor object fed once: torch.export merges inputs that are one object
    (``f(x, x)``, self-attention's ``mha(h, h, h)``), and the graph would read only one of them
    when later calls pass two tensors. A repeat is exported as a copy."""
    seen: set[int] = set()
    distinct = []
    for feed in feeds:
        if isinstance(feed, torch.Tensor) and id(feed) in seen:
            feed = feed.clone()
        seen.add(id(feed))
        distinct.append(feed)
    return distinct


def _output_dtype(leaf: Any) -> torch.dtype | None:
    """The dtype a graph output must have to return ``leaf``: a Python float (a size divided)
    comes back as float64, not as the int64 of sizes (``None``)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.dtype
    return torch.float64 if isinstance(leaf, float) else None


def _guard(plan: CapturePlan, exported: exporters.ExportedGraph, feeds: list[Any], place: serving.Place) -> Guard:
    """The guard of a new graph, checked against the call it was made from."""
    call = plan.call
    rules = []
    for i, (name, value, dims) in enumerate(zip(call.names, feeds, exported.input_dims)):
        if isinstance(value, torch.Tensor):
            rules.append(InputRule(name, dtype_name(value.dtype), tuple(dims)))
        else:
            rules.append(InputRule(name, "int64", None, exported.number_ranges.get(i, (None, None))))
    bounded = dict(exported.dim_ranges)
    for index, axis, lo, hi in plan.bounds:
        dim = rules[index].shape[axis] if rules[index].shape is not None else None
        if isinstance(dim, str):
            was_lo, was_hi = bounded.get(dim, (0, None))
            bounded[dim] = (max(lo, was_lo), hi if was_hi is None else was_hi if hi is None else min(hi, was_hi))
    ranges = tuple((n, lo, hi) for n, (lo, hi) in bounded.items() if lo > 0 or hi is not None)
    dims = [r.shape for r in rules]
    conditions = tuple((tree, evaluate(tree, feeds)) for tree in exported.conditions if not _settled(tree, dims))
    device = next((str(t.device) for t in feeds if isinstance(t, torch.Tensor)), "cpu")
    guard = Guard(tuple(rules), ranges, conditions, device=device, verify_small=True)
    guard = guard.with_example(feeds).with_verified(feeds)
    problem = guard.check(feeds)
    if problem is not None:  # the exporter's contract does not even hold for its own example
        raise CaptureError(f"the exported graph's shapes do not fit the inputs it was exported from: {problem}")
    return guard


def _settled(tree: tuple, dims: Sequence[tuple[int | str, ...] | None]) -> bool:
    """Whether a condition cannot change for any call the dims accept: it reads only static sizes,
    or compares two sides that read the same dims (``x.shape[1] == y.shape[1]`` when both are
    one dim name). Such conditions are dropped instead of evaluated on every call."""

    def named(node: tuple) -> Any:
        if node[0] == "size":
            return dims[node[1]][node[2]] if dims[node[1]] is not None else node
        if node[0] == "num":
            return node
        if node[0] == "const":
            return node[1]
        return (node[0], *(named(child) for child in node[1:]))

    def reads_inputs(node: Any) -> bool:
        if isinstance(node, str) or (isinstance(node, tuple) and node and node[0] in ("size", "num")):
            return True
        return isinstance(node, tuple) and any(reads_inputs(child) for child in node[1:])

    resolved = named(tree)
    if not reads_inputs(resolved):
        return True
    return resolved[0] in ("eq", "le", "ge", "ne", "lt", "gt") and len(resolved) == 3 and resolved[1] == resolved[2]


def _metadata(
    plan: CapturePlan, exported: exporters.ExportedGraph, out_spec: optree.PyTreeSpec, eager_leaves: list[Any],
    scalar_out: dict[int, type], guard: Guard, parameters: Sequence[str],
) -> dict[str, str]:
    """The graph's ``metadata_props`` (metadata.py's schema)."""
    call = plan.call
    fed = set(call.positions)
    in_leaves = {p: treedesc.static_leaf(v) for p, v in enumerate(call.leaves) if p not in fed}
    out_leaves: dict[int, dict[str, Any]] = {pos: treedesc.static_leaf(v) for pos, v in exported.constants.items()}
    for pos, kind in scalar_out.items():
        out_leaves[pos] = {"kind": "scalar", "type": _SCALARS[kind]}
    return metadata.entries({
        metadata.META_SCHEMA: str(metadata.SCHEMA),
        metadata.META_VERSION: VERSION,
        metadata.META_INPUTS: kvcache.shipped(treedesc.describe(call.structure, in_leaves)),
        metadata.META_OUTPUTS: kvcache.shipped(treedesc.describe(out_spec, out_leaves)),
        metadata.META_DIMS: {n: list(d) for n, d in zip(call.names, exported.input_dims)},
        metadata.META_PARAMETERS: list(parameters),
        metadata.META_GUARD: guards.to_json(guard),
    })
