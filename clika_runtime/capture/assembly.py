"""Assembly of a written graph into a ``Capture``: open its session (the reduced-precision graph,
the fused graph or the portable one), make its closures, verify it against eager. Shared by a
fresh export (``capture.build``) and a graph from the disk cache (``cache.restore``).

A graph that fails verification gives way to the next: a reduced-precision graph whose agreement
with eager falls short to the fp32 graph (the capture says why: ``Capture.precision_note``), the
fused graph to the portable one."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

import serving
from clika_runtime.base.config import config
from clika_runtime.base.errors import CaptureError, VerificationError, first_line
from clika_runtime.base.precision import FINITE_ONLY, FP32, Agreement, Record, rows_problem
from clika_runtime.base.specs import TensorInfo
from clika_runtime.capture import closures, containers
from clika_runtime.capture.closures import Stats
from clika_runtime.capture.envelope import Envelope
from clika_runtime.capture.plan import CapturePlan
from clika_runtime.capture.value import Capture, examples
from clika_runtime.capture.verify import agreement_of, first_mismatch
from clika_runtime.guards.guard import Guard
from clika_runtime.shipped.folder import GraphFolder
from clika_runtime.state.weights import Baked
from clika_runtime.trees import kvcache
from clika_runtime.trees import pytrees as trees

logger = logging.getLogger("clika_runtime")


@dataclass
class Made:
    """What a capture is made of, from a fresh export or from the on-disk cache."""

    plan: CapturePlan
    eager_out: Any
    folder: GraphFolder
    guard: Guard
    graph_leaves: list[int]  # output positions the graph computes
    constants: dict[int, Any]  # the other output leaves, by position
    scalar_out: dict[int, type]  # graph outputs returned as Python numbers
    names: list[str]  # a name per output leaf
    baked: tuple[Baked, ...]
    outputs: tuple[TensorInfo, ...]
    phases: dict[str, float]
    precision: str = FP32  # asked for; a reduced one serves only from ``folder.reduced``, if it agrees
    agreement: Agreement = Agreement()
    precision_note: str | None = None  # why the asked precision does not serve


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
    reduced = made.precision != FP32 and made.folder.opened == made.folder.reduced
    # int8 (one activation scale per tensor per call): NaN it cannot carry, calls wider than checked
    int8 = reduced and made.precision in FINITE_ONLY
    envelope = Envelope(feeds, made.names, made.agreement, _shortfall) if int8 else None
    parts = closures.Parts(runner, out_spec, eager_leaves, made.constants, made.graph_leaves, made.scalar_out,
                           tuple(i for i, p in enumerate(call.positions) if p in call.lifted), owner, envelope)
    stats = Stats(phases=made.phases)
    run, flat = closures.closures(parts, made.guard, call.key, call.positions, stats)
    capture = Capture(
        key=call.key, described=call.described, names=call.names, positions=call.positions,
        dynamic=tuple(dict(d) for d in made.plan.dynamic), guard=made.guard, example=examples(feeds),
        baked=made.baked, folder=made.folder, outputs=made.outputs, parts=parts, stats=stats, run=run, flat=flat,
        finish=_finish(call.canonical, made.eager_out, _leaves_at(call)), precision_note=made.precision_note,
    )
    started = time.perf_counter()
    try:
        record = _verify(capture, feeds, eager_leaves, made.names, made.agreement if reduced else None, made.precision)
    except VerificationError as error:
        if reduced:
            made.folder.drop_reduced()
            made.precision_note = f"{made.precision} not served, fp32 serves instead: {first_line(error)}"
        elif not made.folder.drop_fused():
            raise
        else:
            logger.debug("the fused graph disagrees with eager: serving the portable one")
        return assemble(made, place, optimize, owner, keep_optimized)
    made.phases["verify"] = time.perf_counter() - started
    stats.hits = 0  # the verification run served no call
    return capture if record is None else replace(capture, precision=record)


def _shortfall(names: Sequence[str], eager_leaves: list[Any], leaves: list[Any], agreement: Agreement) -> str | None:
    """How an int8 graph's answer falls short of ``agreement`` with eager's (None: it does not):
    the whole outputs, then its rows' errors (``row_error``): one loud row blurs the others
    under one activation scale per tensor, which the whole cannot show."""
    short = agreement_of(names, eager_leaves, leaves, agreement)[1]
    return short if short is not None else _rows_short(names, eager_leaves, leaves, agreement)


def _rows_short(names: Sequence[str], eager_leaves: list[Any], leaves: list[Any], agreement: Agreement) -> str | None:
    floats = [(n, e, g) for n, e, g in zip(names, eager_leaves, leaves)
              if isinstance(e, torch.Tensor) and e.is_floating_point()]
    return next((p for n, e, g in floats if (p := rows_problem(agreement, n, _float64(e), _float64(g)))), None)


def _float64(t: torch.Tensor) -> Any:
    return t.detach().cpu().to(torch.float64).numpy()


def open_served(folder: GraphFolder, place: serving.Place, optimize: bool, keep_optimized: bool) -> Any:
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
        while folder.opened != folder.model:
            try:
                return opened(folder.opened, optimize, keep)
            except Exception as e:  # a derived graph onnxruntime does not take: serve the one it came from
                logger.debug("onnxruntime refused %s, serving the graph it was made from: %s", folder.opened.name,
                             first_line(e))
                folder.drop_reduced() or folder.drop_fused()
        return opened(folder.model, optimize, keep)
    except Exception as e:  # onnxruntime rejects the graph (an op it lacks, a type it cannot run)
        hint = _kernel_hint(e, folder.model)
        raise CaptureError(f"onnxruntime could not load the exported graph: {first_line(e)}{hint}") from e


_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")
# ONNX element types onnxruntime's CPU provider lacks kernels in, by torch's name for them.
_SPARSE_TYPES = {11: "float64", 10: "float16", 16: "bfloat16"}


def _kernel_hint(error: Exception, model: Any) -> str:
    """What to do when onnxruntime has no kernel for an op of the graph: its words name the op
    and its opset only (``Could not find an implementation for Erf(13)``)."""
    missing = _NO_KERNEL.search(str(error))
    if missing is None:
        return ""
    try:
        import onnx

        graph = onnx.load(str(model), load_external_data=False).graph
        kinds = {t.data_type for t in graph.initializer} | {v.type.tensor_type.elem_type for v in graph.input}
    except Exception:  # the file cannot say: the hint without the types
        kinds = set()
    types = " or ".join(sorted(_SPARSE_TYPES[k] for k in kinds if k in _SPARSE_TYPES)) or "this graph's types"
    return (f" (onnxruntime has no {missing.group(1)} kernel for {types} here: convert the model to float32, "
            "model.float(), to have it served)")


def _verify(capture: Capture, feeds: list[Any], eager_leaves: list[Any], names: list[str],
            agreement: Agreement | None, precision: str) -> Record | None:
    """Raise ``VerificationError`` unless the graph agrees with eager: within the fp32 tolerance,
    or by ``agreement`` for a reduced-precision graph (what was measured is returned)."""
    try:
        served = capture.run(feeds)
    except Exception as e:  # onnxruntime failed on the very inputs the graph was exported from
        raise VerificationError(f"the graph failed on the capturing call's inputs: {first_line(e)}") from e
    # The tree is rebuilt from the eager structure by construction; leaves are what can differ.
    leaves = trees.flatten(served)[0]
    problem = first_mismatch(names, eager_leaves, leaves, values=agreement is None)
    if problem:
        raise VerificationError(f"the graph disagrees with eager: {problem}")
    if agreement is None:
        return None
    measured, short = agreement_of(names, eager_leaves, leaves, agreement)
    if not short and precision in FINITE_ONLY:  # judged as a wider call is (capture/envelope.py)
        short = _rows_short(names, eager_leaves, leaves, agreement)
    if short:
        raise VerificationError(f"its agreement with eager fp32 is below the agreement asked for: {short}")
    return Record(precision, agreement, tuple(measured))


def _leaves_at(call: Any) -> dict[tuple, Any]:
    """A call's leaves by their path in its canonical tree, as they were when it was made."""
    return {accessor.path: leaf for accessor, leaf in zip(call.structure.accessors(), call.leaves)}


def _finish(call: tuple, eager_out: Any, before: dict[tuple, Any]) -> Callable[[Any, tuple, dict], Any] | None:
    """What a served call writes back into what it was given: a KV cache (``kvcache.writeback``),
    the dicts and lists the target returned (``containers.writeback``; ``before``: the call's
    leaves by path, as they were before the eager run)."""
    steps = [step for step in (kvcache.writeback(call, eager_out), containers.writeback(call, eager_out, before))
             if step]
    if len(steps) < 2:
        return steps[0] if steps else None
    cache, given = steps

    def finish(out: Any, args: tuple, kwargs: dict) -> Any:
        return given(cache(out, args, kwargs), args, kwargs)

    return finish
