"""``CompiledFunction``: the public shell over one immutable ``CacheTable``.

A call reads the table the function holds (no lock) and is served by a capture's hit, or misses.
A miss plans under the lock (``planning.decide``), then runs the eager target and any capture
outside it (``lifecycle``), and swaps in the table that results. Nothing else lives here.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, Mapping, ParamSpec, Sequence, TypeVar

import torch

import serving
from clika_runtime.base.errors import PlaceError, StateError
from clika_runtime.base.precision import FP32, Agreement, checked, refusal
from clika_runtime.base.specs import DynamicAxes, PlaceLike, TensorSpec, resolve_place
from clika_runtime.capture.closures import MISS, RunFailed
from clika_runtime.capture.envelope import Eagerly
from clika_runtime.capture.described import describe
from clika_runtime.capture.plan import Options
from clika_runtime.capture.target import Target
from clika_runtime.function import hits, lifecycle
from clika_runtime.function.copies import Copies
from clika_runtime.function.table import CacheTable, State, fallen_back
from clika_runtime.shipped.describe import CaptureInfo
from clika_runtime.shipped.graph import ModelGraph
from clika_runtime.trees.calls import CallForms

P = ParamSpec("P")
R = TypeVar("R")

_COMPILED = State.Compiled
_MISS = MISS
_general = hits.general


class CompiledFunction(Copies, Generic[P, R]):
    """A callable whose first call returns the eager result and records an ONNX graph; later
    calls with the same structure and fitting shapes run that graph in onnxruntime, without
    calling Python.

    Tensor leaves of the call's pytree feed the graph; every other leaf is static, part of the
    capture's key by value. A call with a new structure or static value captures again (one
    capture per key, the least recently used dropped past ``config.cache_size``); a call whose
    shapes drift from a capture serves eagerly and re-captures with the drifted axes dynamic.
    Past ``config.recapture_limit`` wasted re-captures (drift, numbers that vary, graphs dropped
    before they served) the function serves eagerly until ``reset()``; a capture that fails (the
    exporter refuses, the graph disagrees with eager, the call mutated an input) makes its own key
    serve eagerly (``eager_keys``) while the others keep capturing. A warning says why, once
    (``fullgraph=True`` raises instead).

    Every new graph is run on the inputs that produced it and compared with the eager result
    before it serves anything. Graphs serve inference: outputs never require grad, and a call
    with grad mode on and an input or a baked weight that requires grad runs eagerly, so
    ``backward()`` works (serve under ``torch.inference_mode()`` or ``torch.no_grad()``). Weights, buffers and
    closed-over tensors are baked into the graph and watched: after ``load_state_dict`` or any
    in-place update, the next call re-captures. Why each re-capture happened is in
    ``recapture_reasons`` and on the ``clika_runtime`` logger.

    Args:
        target: a function, bound method or ``nn.Module`` (its ``forward`` names the inputs).
        signature: the tensor leaves, in flattening order, as ``TensorSpec``s: ``None``/str dims are
            dynamic from the first capture; names become ``input_names``; a call that breaks it
            raises ``SignatureError`` / ``SignatureValueError``.
        dynamic: ``None`` static first, drifted axes become dynamic; ``True`` every axis dynamic
            from the first capture, but axes of size 0 or 1 in that call (torch.export
            specialises them; a capture note says so); ``False`` never dynamic (each shape set
            is its own capture).
        fullgraph: raise ``CaptureError`` instead of falling back to eager.
        optimize: ``False`` exports the graph as is and runs it with basic session optimisation.
        specialize: Python numbers: ``True`` always baked; ``False`` graph inputs from the first
            capture; ``None`` baked first, lifted to graph inputs when their value changes.
        place: where graphs run (``"cpu"``, ``"cuda:1"``, a provider name or list); ``None`` picks
            CUDA for CUDA inputs when onnxruntime has it, else CPU. Unavailable -> ``PlaceError``.
        dynamic_axes: torch.onnx.export's form, for inputs and outputs: dynamic from the first
            capture, with those dim names.
        output_names: graph output names in flattening order (default: from the output pytree).
        graph_name: the ONNX graph's name (default: the target's name).
        precision: ``"fp32"`` (the default) serves what eager computes; ``"int8"`` (CPU) serves the
            verified graph in onnxruntime's dynamic int8 form, ``"fp16"`` (CUDA) in float16
            with the caller's dtypes at its edges. A reduced-precision graph serves only when its
            outputs agree with eager fp32 on the capturing call by ``agreement``; else the fp32
            graph serves, with a warning giving the measured figures (``capture_notes`` too).
            What was measured is in ``captures`` and in the graph ``take_graph()`` hands out.
        agreement: the ``Agreement`` a reduced-precision graph must meet (default:
            ``config.agreement``, cosine >= 0.999 per float output, integer outputs exact).
    """

    State = State

    def __init__(
        self,
        target: Callable[P, R],
        *,
        signature: Sequence[TensorSpec] = (),
        dynamic: bool | None = None,
        fullgraph: bool = False,
        optimize: bool | None = None,
        specialize: bool | None = None,
        place: PlaceLike = None,
        dynamic_axes: DynamicAxes | None = None,
        output_names: Sequence[str] | None = None,
        graph_name: str | None = None,
        precision: str = FP32,
        agreement: Agreement | None = None,
    ) -> None:
        wrapped = _target(target, signature=tuple(signature), dynamic=dynamic, fullgraph=fullgraph, optimize=optimize,
                          specialize=specialize, place=place, dynamic_axes=dynamic_axes, output_names=output_names,
                          graph_name=graph_name, precision=precision, agreement=agreement)
        self._options = {"signature": wrapped.options.signature, "dynamic": dynamic, "fullgraph": fullgraph, "optimize": optimize,
                         "specialize": specialize, "place": place, "dynamic_axes": dynamic_axes,
                         "output_names": output_names, "graph_name": graph_name, "precision": precision,
                         "agreement": agreement}  # for copies
        self._lifecycle = lifecycle.Lifecycle(wrapped, threading.RLock())
        self._forms = wrapped.forms
        self._owner = wrapped.owner
        self._shapes_in_key = wrapped.options.shapes_in_key
        self.__wrapped__ = target
        self.__name__ = wrapped.name
        self.__doc__ = getattr(target, "__doc__", None)

    # ------------------------------------------------------------------------------------ hot path

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        table = self._lifecycle.table
        try:  # (free until something raises)
            if table.state is _COMPILED and table.fresh():  # a graph may serve, and its weights are current
                args_, kwargs_ = self._forms(args, kwargs) if kwargs else (args, kwargs)
                flat = table.flat
                if flat is not None and not kwargs_:
                    out = flat(args_)
                    if out is not _MISS:
                        return out
                out = _general(table, args_, kwargs_, self._shapes_in_key, self._owner)
                if out is not _MISS:
                    return out
        except Eagerly as eagerly:  # an int8 graph's call it does not answer: torch's answer, the graph kept
            return self._lifecycle.eagerly(eagerly, args, kwargs)
        except RunFailed as failed:
            return self._lifecycle.run_failed(failed, args, kwargs)
        except Exception as error:  # the library's own (the target does not run here): served eagerly
            return self._lifecycle.internal_error(error, "serving this call",
                                                  lambda: self._lifecycle.target.eager(args, kwargs))
        table = flat = None  # a re-capture may supersede its captures: their memory goes with it, not later
        return self._lifecycle.miss(args, kwargs)

    # --------------------------------------------------------------------------------- public state

    @property
    def state(self) -> State:
        """``State.Pending``, ``State.Compiled`` or ``State.Fallback`` (see ``State``); with no
        capture held, ``Fallback`` where every key seen was refused (``eager_keys``: a new key may
        still capture), else ``Pending`` (the next call that can captures)."""
        table = self._lifecycle.table
        if table.state is not State.Fallback and not table.entries:
            return State.Fallback if table.refused else State.Pending
        return table.state

    @property
    def recapture_count(self) -> int:
        """How many times a changed structure, static value, weights or drifted shapes forced a new capture."""
        return self._lifecycle.table.recaptures

    @property
    def recapture_reasons(self) -> list[str]:
        """Why each re-capture happened, one entry per re-capture, in order (the most recent
        1000: ``recapture_count`` counts them all)."""
        return list(self._lifecycle.table.reasons)

    @property
    def fallback_reason(self) -> str | None:
        """Why the function serves eagerly (``State.Fallback``): the whole function's reason, or
        the last refused key's; ``None`` otherwise."""
        table = self._lifecycle.table
        if table.state is State.Fallback:
            return table.fallback_why
        return next(reversed(table.refused.values()))[1] if table.refused and not table.entries else None

    @property
    def eager_keys(self) -> dict[str, str]:
        """The keys whose calls serve eagerly because their capture failed, in words, each with
        why (a training-mode call, a dtype onnxruntime cannot run...); other keys still capture."""
        return dict(self._lifecycle.table.refused.values())

    @property
    def capture_notes(self) -> list[str]:
        """What captures had to give up to succeed (numbers baked, axes exported static), in order
        (the most recent 1000)."""
        return list(self._lifecycle.table.notes)

    @property
    def input_names(self) -> list[str]:
        """The graph input names of the current capture (the one most recently created or served)."""
        table = self._lifecycle.table
        current = table.current()
        if current is not None or table.last_names:
            return list(current.names if current is not None else table.last_names)
        signature = self._lifecycle.target.options.signature
        return [s.name for s in signature if s.name] if signature else []

    @property
    def captures(self) -> list[CaptureInfo]:
        """A description of every cached capture: its key in words, inputs and outputs with their
        dims, hit count, last use and how long each phase of the capture took."""
        return [describe(c) for c in self._lifecycle.table.captures]

    def graphs(self) -> list[ModelGraph]:
        """A ``ModelGraph`` (a copy the caller may change) for every cached capture, without
        changing what the function serves."""
        return [c.graph() for c in self._lifecycle.table.captures]

    def reset(self) -> None:
        """Drop every capture, the re-capture count and reasons; the next call captures again."""
        self._lifecycle.reset()

    def take_graph(self) -> ModelGraph:
        """Hand out (a copy of) the current capture's graph (``State.Compiled`` only): of the
        last used key's captures, the most dynamic one.

        The function then serves eagerly (``State.Fallback``) until ``reset()``; its captures
        and their sessions are released.
        """
        with self._lifecycle.lock:
            table = self._lifecycle.table
            current = table.to_ship()
            if table.state is not _COMPILED or current is None:
                state = self.state
                fix = "call it once to capture a graph" if state is State.Pending else "call reset() and capture again"
                raise StateError(f"take_graph() needs State.Compiled, but the function is in {state}: {fix}")
            graph = current.graph()
            self._lifecycle.swap(fallen_back(table, "graph taken by take_graph(); serving eagerly until reset()"))
            return graph

    def __repr__(self) -> str:
        table: CacheTable = self._lifecycle.table
        return f"<CompiledFunction {self.__name__} {self.state.name}, {len(table.captures)} capture(s)>"


# ---------------------------------------------------------------------------------------- helpers


def _target(target: Any, *, signature: tuple[TensorSpec, ...], dynamic: bool | None, fullgraph: bool,
            optimize: bool | None, specialize: bool | None, place: PlaceLike, dynamic_axes: DynamicAxes | None,
            output_names: Sequence[str] | None, graph_name: str | None, precision: str,
            agreement: Agreement | None) -> Target:
    """``compile()``'s arguments checked and resolved once (a bad one raises here, naming it)."""
    if not callable(target):
        raise TypeError(f"compile: expected a callable, got {type(target).__name__}")
    for i, spec in enumerate(signature):
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"signature[{i}]: expected TensorSpec, got {type(spec).__name__}")
    if isinstance(output_names, str):  # each character would have named an output
        raise TypeError(f"output_names: expected a list of names, got the str {output_names!r} "
                        f"(write [{output_names!r}])")
    names = None if output_names is None else tuple(output_names)
    _check_output_names(names)
    axes = _normalise_axes(dynamic_axes or {})
    if dynamic is False and (axes or any(not isinstance(d, int) for s in signature for d in s.shape)):
        raise ValueError("dynamic=False cannot be combined with dynamic_axes or dynamic signature dims")
    resolved = resolve_place(place) if place is not None else None
    _check_precision(checked(precision), agreement, resolved)
    return Target(
        fn=target,
        owner=_owner_module(target),
        forms=CallForms(target.forward if isinstance(target, torch.nn.Module) else target),
        options=Options(signature, dynamic, axes, specialize),
        fullgraph=bool(fullgraph),
        optimize=optimize is not False,
        place=resolved,
        output_names=names,
        graph_name=graph_name or _default_name(target),
        name=getattr(target, "__name__", type(target).__name__),
        precision=precision,
        agreement=agreement,
    )


def _check_output_names(names: tuple[str, ...] | None) -> None:
    for i, name in enumerate(names or ()):
        if not isinstance(name, str) or not name:
            raise TypeError(f"output_names[{i}]: expected a non-empty str, got {name!r}")
    twice = next((n for i, n in enumerate(names or ()) if n in names[:i]), None)
    if twice is not None:
        raise ValueError(f"output_names: {twice!r} given twice: each graph output needs a name of its own")


def _check_precision(precision: str, agreement: Agreement | None, place: Any) -> None:
    """A precision the place cannot serve is refused now, in one line (a place picked per call
    from the inputs is checked at capture: the fp32 graph then serves, said once)."""
    if agreement is not None and not isinstance(agreement, Agreement):
        raise TypeError(f"agreement: expected clika_runtime.Agreement, got {type(agreement).__name__}")
    device = place.device if place is not None else ("cpu" if not serving.cuda_available() else None)
    why = refusal(precision, device) if device is not None else None
    if why is not None:
        raise PlaceError(why)


def _owner_module(target: Any) -> torch.nn.Module | None:
    if isinstance(target, torch.nn.Module):
        return target
    owner = getattr(target, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _default_name(target: Any) -> str:
    if isinstance(target, torch.nn.Module):
        return type(target).__name__
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__


def _normalise_axes(axes: DynamicAxes) -> dict[str, dict[int, str | None]]:
    out: dict[str, dict[int, str | None]] = {}
    for name, spec in axes.items():
        if isinstance(spec, Mapping):
            out[name] = {int(a): (str(n) if n else None) for a, n in spec.items()}
        else:
            out[name] = {int(a): None for a in spec}
    return out
