"""One capture: export the target from a call, open its session, verify it against eager.

A ``Capture`` is immutable once built and serves calls whose key and shapes it matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import optree
import torch

import exporters
import serving
from clika_runtime import graph as graph_mod
from clika_runtime import hits, treedesc, trees
from clika_runtime.config import config
from clika_runtime.errors import CaptureError, VerificationError
from clika_runtime.guards import ShapeGuard
from clika_runtime.verify import first_mismatch

_SCALARS = {int: "int", float: "float", bool: "bool"}


@dataclass
class CaptureRequest:
    """Everything a capture is made from, gathered by ``CompiledFunction`` on a miss."""

    target: Callable[..., Any]
    owner: torch.nn.Module | None
    leaves: list[Any]
    spec: optree.PyTreeSpec  # of (args, kwargs), or of args alone when has_kwargs is False
    has_kwargs: bool
    feed_positions: list[int]
    feed_names: list[str]
    dynamic: list[dict[int, str | None]]
    eager_out: Any
    graph_name: str
    output_names: Sequence[str] | None
    output_dims: dict[str, dict[int, str | None]]
    optimize: bool
    place: serving.Place
    key: tuple
    lifted: frozenset[int] = field(default_factory=frozenset)
    parameters: Sequence[str] = ()  # the target's positional parameter names, for loaded graphs


class Capture:
    """A verified graph for one cache key, with the guard that says which shapes it may serve."""

    def __init__(
        self, request: CaptureRequest, exported: exporters.ExportedGraph, runner: serving.TorchRunner,
        out_spec: optree.PyTreeSpec, eager_leaves: list[Any], scalar_out: dict[int, type], keep: Any = None,
    ) -> None:
        self._keep = keep  # a temporary folder with the external data of a model past protobuf's limit
        self.key = request.key
        self.feed_names = list(request.feed_names)
        self.dynamic = [dict(d) for d in request.dynamic]
        self.model_proto = exported.model_proto
        lifted = _lifted_feeds(request)
        self.guard = ShapeGuard(
            tuple(None if i in lifted else dims for i, dims in enumerate(exported.input_dims)),
            tuple((name, lo, hi) for name, (lo, hi) in exported.dim_ranges.items() if lo > 0 or hi is not None),
            tuple((i, lo, hi) for i, (lo, hi) in exported.number_ranges.items()),
            tuple(exported.conditions),
        )
        self._runner = runner
        self._out_spec = out_spec
        self._lift = sorted(lifted)
        graph_leaves = exported.graph_leaves
        template: list[Any] = [None] * len(eager_leaves)
        for pos, value in exported.constants.items():
            template[pos] = value
        self._template = template
        self._slots = [(pos, scalar_out.get(pos)) for pos in graph_leaves]
        direct = not exported.constants and not scalar_out and not self._lift
        # run(feeds) -> the output tree; the common case (every output leaf a tensor the graph
        # computes, no lifted numbers) is one closure over the runner, and has a flat hit.
        self.run: Callable[[Sequence[Any]], Any] = self._run
        self.flat_hit: hits.FlatHit | None = None
        if direct:
            leaf = out_spec.is_leaf()
            finish = None if leaf else trees.rebuilder(out_spec, eager_leaves)
            self.run = _direct_run(runner.run, finish)
            serve = runner.server(hits.shapes_for(self.guard), first=leaf)
            self.flat_hit = hits.flat_hit(self.key, request.feed_positions, request.owner, self.guard, serve, finish)

    def _run(self, feeds: Sequence[Any]) -> Any:
        if self._lift:
            feeds = list(feeds)
            for i in self._lift:
                feeds[i] = torch.tensor(feeds[i])
        return self._out_spec.unflatten(self._leaves(self._runner.run(feeds)))

    def _leaves(self, outs: Sequence[Any]) -> list[Any]:
        leaves = list(self._template)
        for (pos, scalar), value in zip(self._slots, outs):
            leaves[pos] = scalar(value.item()) if scalar is not None else value
        return leaves


def _direct_run(run: Callable[[Sequence[Any]], list[Any]], rebuild: Callable | None) -> Callable:
    if rebuild is None:  # one tensor out, the most common case: no tree to rebuild
        return lambda feeds: run(feeds)[0]
    return lambda feeds: rebuild(run(feeds))


def _lifted_feeds(request: CaptureRequest) -> set[int]:
    return {i for i, pos in enumerate(request.feed_positions) if pos in request.lifted}


def build(request: CaptureRequest) -> Capture:
    """Export, open a session and verify. Raises ``CaptureError`` (``VerificationError``) with why."""
    eager_leaves, out_spec = trees.flatten(request.eager_out)
    for pos, leaf in enumerate(eager_leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dtype not in exporters.dtypes.TORCH_TO_ONNX:
            raise CaptureError(f"output {pos}: dtype {leaf.dtype} has no ONNX type")
    names = _output_names(request, eager_leaves)
    exported = _export(request, names, eager_leaves)
    opaque_axes = {(i, a) for i, a in exported.opaque if a is not None}
    if opaque_axes:  # branches on sizes we cannot re-check: export those axes static instead
        request.dynamic = [{a: n for a, n in d.items() if (i, a) not in opaque_axes} for i, d in enumerate(request.dynamic)]
        exported = _export(request, names, eager_leaves)
    unliftable = set(exported.specialized) | {i for i, a in exported.opaque if a is None}
    baked = [request.feed_names[i] for i in sorted(unliftable) if i in _lifted_feeds(request)]
    if baked:
        raise CaptureError(f"the exporter specialised number input(s) {baked} to their example values")
    if not exported.graph_leaves:
        raise CaptureError("the function returns no tensor: there is nothing for a graph to compute")
    scalar_out = {
        pos: type(eager_leaves[pos]) for pos in exported.graph_leaves if type(eager_leaves[pos]) in _SCALARS
    }
    _attach_metadata(request, exported, out_spec, eager_leaves, scalar_out)
    graph_outputs = [names[pos] for pos in exported.graph_leaves]
    source, folder = graph_mod.session_source(exported.model_proto)
    try:
        session = serving.open_session(
            source, request.place,
            optimize=request.optimize, intra_op_threads=config.intra_op_threads or torch.get_num_threads(),
        )
    except Exception as e:  # onnxruntime rejects the graph (an op it lacks, a type it cannot run)
        raise CaptureError(f"onnxruntime could not load the exported graph: {e}") from e
    feeds = [request.leaves[p] for p in request.feed_positions]
    device = next((t.device for t in feeds if isinstance(t, torch.Tensor)), None)
    runner = serving.TorchRunner(
        session, request.place, request.feed_names, graph_outputs,
        [t.dtype if isinstance(t, torch.Tensor) else torch.int64 for t in feeds]
        + [leaf.dtype for leaf in eager_leaves if isinstance(leaf, torch.Tensor)],
        input_device=device,
    )
    capture = Capture(request, exported, runner, out_spec, eager_leaves, scalar_out, keep=folder)
    _verify(capture, feeds, eager_leaves, names)
    return capture


def _output_names(request: CaptureRequest, eager_leaves: list[Any]) -> list[str]:
    defaults = trees.output_names(request.eager_out, eager_leaves)
    if request.output_names is None:
        return defaults
    computed = [i for i, leaf in enumerate(eager_leaves) if isinstance(leaf, (torch.Tensor, int, float))]
    given = list(request.output_names)
    if len(given) != len(computed):
        raise CaptureError(
            f"output_names: expected {len(computed)} names (one per computed output leaf: "
            f"{[defaults[i] for i in computed]}), got {len(given)}: {given}"
        )
    names = list(defaults)
    for i, name in zip(computed, given):
        names[i] = name
    return trees.unique(names)


def _export(request: CaptureRequest, names: list[str], eager_leaves: list[Any]) -> exporters.ExportedGraph:
    template = list(request.leaves)
    positions = request.feed_positions
    target = request.target

    def flat(*feeds: Any) -> list[Any]:
        leaves = list(template)
        for pos, value in zip(positions, feeds):
            leaves[pos] = value
        args, kwargs = _call_tree(request, leaves)
        return trees.flatten(target(*args, **kwargs))[0]

    examples = [request.leaves[p] for p in positions]
    try:
        return exporters.export_graph(
            flat,
            examples,
            input_names=request.feed_names,
            output_names=names,
            output_dtypes=[leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in eager_leaves],
            dynamic=request.dynamic,
            graph_name=request.graph_name,
            output_dims=request.output_dims,
            optimize=request.optimize,
            owner=request.owner,
        )
    except RuntimeError as e:
        raise CaptureError(f"the exporter failed: {e}") from e


def _call_tree(request: CaptureRequest, leaves: list[Any]) -> tuple[tuple, dict]:
    tree = request.spec.unflatten(leaves)
    return tree if request.has_kwargs else (tree, {})


def _verify(capture: Capture, feeds: list[Any], eager_leaves: list[Any], names: list[str]) -> None:
    try:
        served = capture.run(feeds)
    except Exception as e:  # onnxruntime failed on the very inputs the graph was exported from
        raise VerificationError(f"the graph failed on the capturing call's inputs: {e}") from e
    # The tree is rebuilt from the eager structure by construction; leaves are what can differ.
    problem = first_mismatch(names, eager_leaves, trees.flatten(served)[0])
    if problem:
        raise VerificationError(f"the graph disagrees with eager: {problem}")


def _attach_metadata(
    request: CaptureRequest, exported: exporters.ExportedGraph, out_spec: optree.PyTreeSpec,
    eager_leaves: list[Any], scalar_out: dict[int, type],
) -> None:
    feeds = set(request.feed_positions)
    in_leaves = {p: treedesc.static_leaf(v) for p, v in enumerate(request.leaves) if p not in feeds}
    out_leaves: dict[int, dict[str, Any]] = {
        pos: treedesc.static_leaf(value) for pos, value in exported.constants.items()
    }
    for pos, kind in scalar_out.items():
        out_leaves[pos] = {"kind": "scalar", "type": _SCALARS[kind]}
    graph_mod.attach_metadata(
        exported.model_proto,
        {
            graph_mod.META_VERSION: graph_mod.VERSION,
            graph_mod.META_INPUTS: treedesc.describe(trees.flatten(_call_tree(request, request.leaves))[1], in_leaves),
            graph_mod.META_OUTPUTS: treedesc.describe(out_spec, out_leaves),
            graph_mod.META_DIMS: {n: list(d) for n, d in zip(request.feed_names, exported.input_dims)},
            graph_mod.META_PARAMETERS: list(request.parameters),
        },
    )
