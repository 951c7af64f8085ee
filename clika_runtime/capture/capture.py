"""One capture: export the target from a call, open its session, verify it against eager.

``build`` turns a ``CapturePlan`` and the eager result of its call into a ``Capture``, or raises
``CaptureError`` saying why: any failure on the way (exporter, graph edits, onnxruntime, runner,
verification) is a capture failure, so the caller always keeps the eager result it is owed.
How a capture then serves calls (its hot-path closures) lives in ``hits.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, NamedTuple, Sequence

import optree
import torch

import exporters
import serving
from clika_runtime.base.config import config
from clika_runtime.base.errors import CaptureError, UncapturableError, VerificationError, first_line
from clika_runtime.base.specs import TensorInfo
from clika_runtime.base.version import VERSION
from clika_runtime.capture import closures, fusing, hints
from clika_runtime.capture.closures import Stats
from clika_runtime.capture.plan import CapturePlan
from clika_runtime.capture.verify import first_mismatch
from clika_runtime.format import metadata, treedesc
from clika_runtime.guards import json_form as guards
from clika_runtime.guards.conditions import evaluate
from clika_runtime.guards.guard import Guard, InputRule, dtype_name
from clika_runtime.shipped import graph as graph_mod
from clika_runtime.state.weights import Baked, bake
from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.calls import CallForms
from clika_runtime.trees.key import CallKey, Described

_SCALARS = {int: "int", float: "float", bool: "bool"}


_monotonic = time.monotonic
logger = logging.getLogger("clika_runtime")


class Example(NamedTuple):
    """What the guard reads of one input of the call a capture was made from."""

    shape: tuple[int, ...] | None  # None: a lifted Python number (``value`` holds it)
    dtype: Any
    device: str
    value: Any = None

    @property
    def is_cpu(self) -> bool:
        """As ``torch.Tensor.is_cpu``."""
        return self.device == "cpu"


@dataclass(frozen=True, repr=False)
class Capture:
    """A verified graph for one cache key, the guard saying which calls it may serve, and the
    closures that serve them (``run``: fed leaves -> output tree; ``flat``: the flat hit)."""

    key: CallKey
    described: Described
    names: tuple[str, ...]
    positions: tuple[int, ...]  # canonical leaf positions of the fed leaves
    dynamic: tuple[dict[int, str | None], ...]
    guard: Guard
    example: tuple[Example, ...]
    baked: tuple[Baked, ...]
    folder: graph_mod.GraphFolder  # the graph's file, for take_graph() / graphs() and the disk cache
    outputs: tuple[TensorInfo, ...]  # the graph outputs
    parts: closures.Parts
    stats: Stats
    run: Callable[[Sequence[Any]], Any]
    flat: Callable[[tuple], Any] | None
    finish: Callable[[Any, tuple, dict], Any] | None = None  # a served call's KV-cache write-back (kvcache.writeback)

    def __repr__(self) -> str:
        return f"<Capture {', '.join(map(str, self.guard.inputs))}>"

    def graph(self) -> graph_mod.ModelGraph:
        """The capture's graph to hand out: a copy, carrying the guard as it stands now (with
        the sizes 0/1 verified since the capture)."""
        graph = graph_mod.ModelGraph.load(self.folder.model)
        metadata.attach(graph.model_proto, {metadata.META_GUARD: guards.to_json(self.guard)})
        return graph

    def verified_at(self, feeds: Sequence[Any]) -> "Capture":
        """This capture, also serving the point of ``feeds`` (checked against eager by the caller)."""
        guard = self.guard.with_verified(feeds)
        run, flat = closures.closures(self.parts, guard, self.key, self.positions, self.stats)
        return replace(self, guard=guard, run=run, flat=flat)


def build(
    plan: CapturePlan, eager_out: Any, *, target: Callable[..., Any], forms: CallForms, owner: torch.nn.Module | None,
    output_names: Sequence[str] | None, output_axes: dict[str, dict[int, str | None]], graph_name: str,
    optimize: bool, place: serving.Place, parameters: Sequence[str],
    exporting: Callable[[], ContextManager[Any]] = contextlib.nullcontext, work_dir: str | None = None,
) -> Capture:
    """Export, write the graph to a folder (under ``work_dir``), open a session and verify.
    Raises ``CaptureError`` (``VerificationError``) with why.

    ``exporting`` is held around the export: the target must not run eagerly meanwhile.
    """
    try:
        with torch.inference_mode(False), torch.no_grad():
            return _build(plan, eager_out, target, forms, owner, output_names, output_axes, graph_name, optimize,
                          place, parameters, exporting, work_dir)
    except CaptureError:
        raise
    except Exception as e:  # anything else on the way is a capture failure too, never a lost call
        raise CaptureError(f"{type(e).__name__} while capturing: {first_line(e)}") from e


def _build(
    plan: CapturePlan, eager_out: Any, target: Callable[..., Any], forms: CallForms, owner: torch.nn.Module | None,
    output_names: Sequence[str] | None, output_axes: dict, graph_name: str, optimize: bool, place: serving.Place,
    parameters: Sequence[str], exporting: Callable[[], ContextManager[Any]], work_dir: str | None,
) -> Capture:
    phases: dict[str, float] = {}
    call = plan.call
    trees.adopt(eager_out)  # a dataclass of tensors returned: a node, as it is passed in
    eager_leaves, out_spec = trees.flatten(eager_out)
    hints.check_inputs(call.feeds, call.names)
    hints.check_outputs(eager_leaves)
    names = output_names_of(eager_out, eager_leaves, output_names)
    trace = _tracer(plan, target, forms)
    started = time.perf_counter()
    with exporting():  # also while looking up the baked tensors: no other export swaps them for fakes
        exported = _export(plan, trace, names, eager_leaves, graph_name, output_axes, optimize, owner)
        baked = tuple(bake(exported.state, exported.constants_read, owner, target))
    phases["export"] = time.perf_counter() - started
    guard = _guard(plan, exported, list(call.feeds), place)
    scalar_out = {pos: type(eager_leaves[pos]) for pos in exported.graph_leaves if type(eager_leaves[pos]) in _SCALARS}
    metadata_entries = _metadata(plan, exported, out_spec, eager_leaves, scalar_out, guard, parameters)
    outputs = tuple(TensorInfo(*o) for o in exporters.outputs(exported))
    started = time.perf_counter()
    folder = graph_mod.GraphFolder(work_dir)
    exporters.save(exported, str(folder.model), metadata_entries, graph_mod.EXTERNAL_ABOVE)
    phases["save"] = time.perf_counter() - started
    if optimize:
        started = time.perf_counter()
        fusing.fuse(exported, folder)
        if exporters.model_bytes(exported) < fusing.MEASURED_BELOW:
            fusing.keep_if_faster(folder, place, call.names, call.feeds, config.session_threads())
        phases["fuse"] = time.perf_counter() - started
    made = Made(plan, eager_out, folder, guard, list(exported.graph_leaves), dict(exported.constants), scalar_out,
                names, baked, outputs, phases)
    return assemble(made, place, optimize, owner, keep_optimized=work_dir is not None)


@dataclass
class Made:
    """What a capture is made of, from a fresh export or from the on-disk cache."""

    plan: CapturePlan
    eager_out: Any
    folder: graph_mod.GraphFolder
    guard: Guard
    graph_leaves: list[int]  # output positions the graph computes
    constants: dict[int, Any]  # the other output leaves, by position
    scalar_out: dict[int, type]  # graph outputs returned as Python numbers
    names: list[str]  # a name per output leaf
    baked: tuple[Baked, ...]
    outputs: tuple[TensorInfo, ...]
    phases: dict[str, float]


def assemble(made: Made, place: serving.Place, optimize: bool, owner: torch.nn.Module | None,
             keep_optimized: bool = False, session: Any = None) -> Capture:
    """Open the session of a written graph (unless ``session``, opened by ``open_served``, is
    given), make its closures, and verify it against eager.

    ``keep_optimized``: the folder keeps onnxruntime's optimised model for this machine, and a
    folder that has one opens it without optimising again (the slow part of opening a big model).
    """
    call = made.plan.call
    feeds = list(call.feeds)
    eager_leaves, out_spec = trees.flatten(made.eager_out)
    graph_outputs = [made.names[pos] for pos in made.graph_leaves]
    started = time.perf_counter()
    session = session or open_served(made.folder, place, optimize, keep_optimized)
    device = next((t.device for t in feeds if isinstance(t, torch.Tensor)), None)
    runner = serving.TorchRunner(
        session, place, call.names, graph_outputs,
        [t.dtype if isinstance(t, torch.Tensor) else torch.int64 for t in feeds]
        + [leaf.dtype for leaf in eager_leaves if isinstance(leaf, torch.Tensor)],
        input_device=device,
    )
    made.phases["session"] = time.perf_counter() - started
    parts = closures.Parts(runner, out_spec, eager_leaves, made.constants, made.graph_leaves, made.scalar_out,
                       tuple(i for i, p in enumerate(call.positions) if p in call.lifted), owner)
    stats = Stats(phases=made.phases)
    run, flat = closures.closures(parts, made.guard, call.key, call.positions, stats)
    capture = Capture(
        key=call.key, described=call.described, names=call.names, positions=call.positions,
        dynamic=tuple(dict(d) for d in made.plan.dynamic), guard=made.guard, example=examples(feeds),
        baked=made.baked, folder=made.folder, outputs=made.outputs, parts=parts, stats=stats, run=run, flat=flat,
        finish=kvcache.writeback(call.canonical, made.eager_out),
    )
    started = time.perf_counter()
    try:
        _verify(capture, feeds, eager_leaves, made.names)
    except VerificationError:
        if not made.folder.drop_fused():
            raise
        logger.debug("the fused graph disagrees with eager: serving the portable one")
        return assemble(made, place, optimize, owner, keep_optimized)
    made.phases["verify"] = time.perf_counter() - started
    stats.hits = 0  # the verification run served no call
    return capture


def open_served(folder: graph_mod.GraphFolder, place: serving.Place, optimize: bool, keep_optimized: bool) -> Any:
    """The session of the file a folder serves (``GraphFolder.opened``); ``CaptureError`` when
    onnxruntime takes neither the fused nor the portable graph."""
    optimized = folder.optimized(serving.machine_tag(place))
    threads = config.session_threads()

    def opened(path: Any, level: bool | None, keep: Any = None) -> Any:
        return serving.open_session(str(path), place, optimize=level, intra_op_threads=threads, keep_optimized=keep)

    try:
        if keep_optimized and optimize and optimized.is_file():
            return opened(optimized, None)
        keep = str(optimized) if keep_optimized and optimize else None
        if folder.opened != folder.model:
            try:
                return opened(folder.opened, optimize, keep)
            except Exception as e:  # the rewriter's graph is not one onnxruntime takes: serve the portable one
                logger.debug("onnxruntime refused the fused graph, serving the portable one: %s", first_line(e))
                folder.drop_fused()
        return opened(folder.model, optimize, keep)
    except Exception as e:  # onnxruntime rejects the graph (an op it lacks, a type it cannot run)
        raise CaptureError(f"onnxruntime could not load the exported graph: {first_line(e)}") from e


def examples(feeds: Sequence[Any]) -> tuple[Example, ...]:
    """What the guard reads of each fed leaf, kept without the tensors themselves."""
    return tuple(
        Example(tuple(f.shape), f.dtype, str(f.device)) if isinstance(f, torch.Tensor) else Example(None, type(f), "cpu", f)
        for f in feeds
    )


def _tracer(plan: CapturePlan, target: Callable[..., Any], forms: CallForms) -> Callable[..., list[Any]]:
    """The target as a function of the fed leaves, called exactly as the user called it."""
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
        return trees.flatten(target(*args, **kwargs))[0]

    return flat


def output_names_of(eager_out: Any, eager_leaves: list[Any], given: Sequence[str] | None) -> list[str]:
    """A name per output leaf: the user's ``output_names`` for the leaves a graph computes, else
    names from the output pytree's keys and paths."""
    defaults = kvcache.renamed(trees.flatten(eager_out)[1], trees.output_names(eager_out, eager_leaves), kvcache.PRESENT)
    if given is None:
        return defaults
    computed = [i for i, leaf in enumerate(eager_leaves) if isinstance(leaf, (torch.Tensor, int, float))]
    if len(given) != len(computed):
        raise CaptureError(
            f"output_names: expected {len(computed)} names (one per computed output leaf: "
            f"{[defaults[i] for i in computed]}), got {len(given)}: {list(given)}"
        )
    names = list(defaults)
    for i, name in zip(computed, given):
        names[i] = name
    return trees.unique(names)


def _export(
    plan: CapturePlan, trace: Callable[..., list[Any]], names: list[str], eager_leaves: list[Any], graph_name: str,
    output_axes: dict, optimize: bool, owner: torch.nn.Module | None,
) -> exporters.ExportedGraph:
    call = plan.call
    dynamic = [dict(d) for d in plan.dynamic]

    def export() -> exporters.ExportedGraph:
        try:
            return exporters.export_graph(
                trace, _distinct(call.feeds), input_names=list(call.names), output_names=names,
                output_dtypes=[_output_dtype(leaf) for leaf in eager_leaves],
                dynamic=dynamic, graph_name=graph_name, output_dims=output_axes, optimize=optimize, owner=owner,
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
    ranges = tuple((n, lo, hi) for n, (lo, hi) in exported.dim_ranges.items() if lo > 0 or hi is not None)
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


def _verify(capture: Capture, feeds: list[Any], eager_leaves: list[Any], names: list[str]) -> None:
    try:
        served = capture.run(feeds)
    except Exception as e:  # onnxruntime failed on the very inputs the graph was exported from
        raise VerificationError(f"the graph failed on the capturing call's inputs: {first_line(e)}") from e
    # The tree is rebuilt from the eager structure by construction; leaves are what can differ.
    problem = first_mismatch(names, eager_leaves, trees.flatten(served)[0])
    if problem:
        raise VerificationError(f"the graph disagrees with eager: {problem}")


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
