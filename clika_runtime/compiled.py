"""``CompiledFunction``: the capture lifecycle. The hit path fits on one screen; misses go to helpers."""

from __future__ import annotations

import enum
import logging
import sys
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, ParamSpec, Sequence, TypeVar

import torch

import serving
from clika_runtime import capture as capture_mod
from clika_runtime import hits, trees
from clika_runtime.calls import CallForms
from clika_runtime.config import config
from clika_runtime.errors import CaptureError, PlaceError, SignatureError, SignatureValueError, StateError
from clika_runtime.graph import ModelGraph
from clika_runtime.guards import describe_key_change, key_parts
from clika_runtime.specs import DynamicAxes, PlaceLike, TensorSpec

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("clika_runtime")
_flatten = trees.flatten
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_NO_LIFT: frozenset[int] = frozenset()
_MISS = hits.MISS
# Graphs kept per key for sizes on either side of a branch the trace took (`if seq == 1:`), so
# calls alternating across it stop re-capturing once each side has its graph.
_VARIANTS = 4


@dataclass
class Call:
    """One call, flattened and split: what the miss path decides from."""

    args: tuple
    kwargs: dict
    leaves: list[Any]
    spec: Any
    lifted: frozenset[int]  # leaf positions of Python numbers fed to the graph
    feeds: list[Any]  # leaves fed to the graph, in order
    positions: list[int]  # their leaf positions
    names: list[str]  # their graph input names
    static_names: list[str]  # names of the non-tensor leaves, in order
    key: tuple


class State(enum.Enum):
    """Where the function is in its capture lifecycle.

    ``Pending``: nothing captured yet. ``Compiled``: a captured graph serves calls whose structure
    and shapes it matches. ``Fallback``: serving eagerly, and not re-capturing, until ``reset()``.
    """

    Pending = "pending"
    Compiled = "compiled"
    Fallback = "fallback"


_COMPILED = State.Compiled


class CompiledFunction(Generic[P, R]):
    """A callable whose first call returns the eager result and records an ONNX graph; later
    calls with the same structure and fitting shapes run that graph in onnxruntime, without
    calling Python.

    Tensor leaves of the call's pytree feed the graph; every other leaf is static, baked into the
    capture and part of its key. A call with a new structure or static value captures again (one
    capture per key, the least recently used dropped past ``config.cache_size``); a call whose
    shapes drift from a capture serves eagerly and re-captures with the drifted axes dynamic.
    Past ``config.recapture_limit`` re-captures, or when a capture fails (the exporter refuses,
    the graph disagrees with eager, the call mutated an input), the function serves eagerly until
    ``reset()``, with a warning that says why (``fullgraph=True`` raises instead).

    Every new graph is run on the inputs that produced it and compared with the eager result
    before it serves anything. Graphs serve inference: outputs never require grad, and a call
    with grad mode on and an input that requires grad runs eagerly.

    Weights are baked into the graph at capture: after changing a module's weights, call
    ``reset()``. Why each re-capture happened is in ``recapture_reasons`` and on the
    ``clika_runtime`` logger.

    Args:
        target: a function, bound method or ``nn.Module`` (its ``forward`` names the inputs).
        signature: the tensor leaves, in flattening order, as ``TensorSpec``s: ``None``/str dims are
            dynamic from the first capture; names become ``input_names``; a call that breaks it
            raises ``SignatureError`` / ``SignatureValueError``.
        dynamic: ``None`` static first, drifted axes become dynamic; ``True`` every axis dynamic
            from the first capture; ``False`` never dynamic (each shape set is its own capture).
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
    ) -> None:
        if not callable(target):
            raise TypeError(f"compile: expected a callable, got {type(target).__name__}")
        if dynamic is False and (dynamic_axes or any(_has_dynamic(s) for s in signature)):
            raise ValueError("dynamic=False cannot be combined with dynamic_axes or dynamic signature dims")
        for i, spec in enumerate(signature):
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"signature[{i}]: expected TensorSpec, got {type(spec).__name__}")
        self._target = target
        self._owner = _owner_module(target)
        self._forms = CallForms(target.forward if isinstance(target, torch.nn.Module) else target)
        self._signature = tuple(signature)
        self._dynamic = dynamic
        self._shapes_in_key = dynamic is False
        self._fullgraph = bool(fullgraph)
        self._optimize = optimize is not False
        self._specialize = specialize
        self._place = _resolve_place(place) if place is not None else None
        self._dynamic_axes = _normalise_axes(dynamic_axes or {})
        self._output_names = None if output_names is None else list(output_names)
        self._graph_name = graph_name or _default_name(target)
        self._lock = threading.RLock()
        self.__wrapped__ = target
        self.__name__ = getattr(target, "__name__", type(target).__name__)
        self.__doc__ = getattr(target, "__doc__", None)
        self._warned: set[str] = set()
        self.reset()

    # ------------------------------------------------------------------------------------ hot path

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._state is _COMPILED:
            if kwargs:
                args, kwargs = self._forms(args, kwargs)
            flat = self._flat_hit  # the current capture's check and run for calls of plain tensors
            if flat is not None and not kwargs:
                out = flat(args)
                if out is not _MISS:
                    return out
            leaves, spec = _flatten((args, kwargs)) if kwargs else _flatten(args)
            lifted = self._lifted.get(spec, _NO_LIFT) if self._lifted else _NO_LIFT
            feeds, statics, metas, grad = key_parts(leaves, lifted, self._shapes_in_key)
            owner = self._owner
            try:
                entry = self._captures.get((spec, statics, metas, owner.training if owner is not None else None))
            except TypeError:  # an unhashable static leaf: the miss path explains it
                entry = None
            if entry is not None and not (grad and _grad_enabled()):
                for capture in entry:  # almost always one; more when the trace branched on sizes
                    if capture.guard.matches(feeds):
                        if capture is not self._current:
                            self._touch(capture)
                        try:
                            return capture.run(feeds)
                        except Exception as error:  # the graph rejected inputs its guard let through
                            return self._run_failed(capture, error, args, kwargs)
        return self._miss(args, kwargs)

    # --------------------------------------------------------------------------------- public state

    @property
    def state(self) -> State:
        """``State.Pending``, ``State.Compiled`` or ``State.Fallback`` (see ``State``)."""
        return self._state

    @property
    def recapture_count(self) -> int:
        """How many times a changed structure, static value or drifted shapes forced a new capture."""
        return self._recaptures

    @property
    def recapture_reasons(self) -> list[str]:
        """Why each re-capture happened, one entry per re-capture, in order."""
        return list(self._reasons)

    @property
    def fallback_reason(self) -> str | None:
        """Why the function serves eagerly (``State.Fallback``); ``None`` otherwise."""
        return self._fallback_why if self._state is State.Fallback else None

    @property
    def capture_notes(self) -> list[str]:
        """What captures had to give up to succeed (numbers baked, axes exported static), in order."""
        return list(self._notes)

    @property
    def input_names(self) -> list[str]:
        """The graph input names of the current capture, in flattening order."""
        if self._current is not None:
            return list(self._current.feed_names)
        return [s.name for s in self._signature if s.name] if self._signature else []

    def reset(self) -> None:
        """Drop every capture, the re-capture count and reasons; the next call captures again."""
        with self._lock:
            # key -> its captures: one, or a few variants when the trace branched on sizes
            self._captures: OrderedDict[tuple, list[capture_mod.Capture]] = OrderedDict()
            self._current: capture_mod.Capture | None = None
            self._flat_hit: hits.FlatHit | None = None
            self._last_key: tuple | None = None
            self._lifted: dict[Any, frozenset[int]] = {}
            self._unliftable: dict[Any, frozenset[int]] = {}  # numbers the exporter could not lift
            self._run_failure: str | None = None  # why the last served call failed, for the re-capture
            self._static_axes: set[tuple[str, int]] = set()  # (input, axis) the exporter could not make dynamic
            self._recaptures = 0
            self._reasons: list[str] = []
            self._notes: list[str] = []
            self._fallback_why: str | None = None
            self._state = State.Pending

    def take_graph(self) -> ModelGraph:
        """Hand out the current capture's graph (``State.Compiled`` only).

        The function then serves eagerly (``State.Fallback``) until ``reset()``.
        """
        with self._lock:
            if self._state is not _COMPILED or self._current is None:
                raise StateError(
                    f"take_graph() needs State.Compiled, but the function is in {self._state}: "
                    + ("call it once to capture a graph" if self._state is State.Pending else "call reset() and capture again")
                )
            graph = ModelGraph(self._current.model_proto)
            self._fallback("graph taken by take_graph(); serving eagerly until reset()", warn=False)
            return graph

    def __repr__(self) -> str:
        return f"<CompiledFunction {self.__name__} {self._state.name}, {sum(map(len, self._captures.values()))} capture(s)>"

    # ------------------------------------------------------------------------------------ miss path

    def _miss(self, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            if self._state is State.Fallback:
                return self._target(*args, **kwargs)
            args, kwargs = self._forms(args, kwargs)
            trees.sync_registry()  # node types registered since the last miss flatten from now on
            leaves, spec = _flatten((args, kwargs)) if kwargs else _flatten(args)
            call = self._call(args, kwargs, leaves, spec, self._lifted.get(spec, self._initial_lift(spec, leaves)))
            self._check_signature(call)
            if _grad_enabled() and any(isinstance(t, _Tensor) and t.requires_grad for t in call.feeds):
                return self._target(*args, **kwargs)  # the caller is differentiating: stay eager
            try:
                hash(call.key)
            except TypeError:
                return self._unhashable(args, kwargs, leaves)
            entry = self._captures.get(call.key, [])
            for existing in entry:
                if existing.guard.matches(call.feeds):  # captured by another thread meanwhile
                    self._touch(existing)
                    return existing.run(call.feeds)
            variant = False
            if entry:
                existing = entry[-1]
                # Only a size condition flipped: the new graph joins this key's variants.
                variant = existing.guard.matches(call.feeds, conditions=False)
                drifted, reasons = existing.guard.drift(call.feeds, existing.feed_names)
                dynamic = [
                    self._without_static({**{a: None for a in axes}, **d}, name, declared)
                    for d, axes, name, declared in zip(existing.dynamic, drifted, call.names, self._declared_axes(call))
                ]
            else:
                lifted, reasons = self._lift_changed_numbers(call)
                if reasons:  # numbers became graph inputs: they leave the key
                    call = self._call(args, kwargs, leaves, spec, lifted)
                elif self._run_failure is not None:
                    reasons, self._run_failure = [self._run_failure], None
                elif self._last_key is not None:
                    tensor_names = [n for n, v in zip(call.names, call.feeds) if isinstance(v, _Tensor)]
                    reasons = [describe_key_change(self._last_key, call.key, call.static_names, tensor_names)]
                dynamic = self._initial_dynamic(call)
            if self._last_key is not None:
                if self._recaptures >= config.recapture_limit:
                    why = f"re-capture limit ({config.recapture_limit}) reached; last: {'; '.join(reasons)}"
                    return self._give_up(why, args, kwargs, run_eager=True)
                self._recaptures += 1
                self._record(reasons)
            return self._capture(call, dynamic, variant)

    def _run_failed(self, capture: capture_mod.Capture, error: Exception, args: tuple, kwargs: dict) -> Any:
        """A graph failed on inputs its guard accepted: drop it and capture again from this call."""
        with self._lock:
            self._flat_hit = None
            rest = [c for c in self._captures.get(capture.key, []) if c is not capture]
            if rest:
                self._captures[capture.key] = rest
            else:
                self._captures.pop(capture.key, None)
            self._run_failure = f"the graph failed on these inputs ({_first_line(error)}); re-captured from them"
        return self._miss(args, kwargs)

    def _call(self, args: tuple, kwargs: dict, leaves: list[Any], spec: Any, lifted: frozenset[int]) -> Call:
        """Flatten-side facts of one call under a given set of lifted numbers."""
        feeds, statics, metas, _ = key_parts(leaves, lifted, self._shapes_in_key)
        positions = [i for i, v in enumerate(leaves) if isinstance(v, _Tensor) or i in lifted]
        leaf_names = self._leaf_names(args, kwargs, leaves)
        training = self._owner.training if self._owner is not None else None
        return Call(
            args=args, kwargs=kwargs, leaves=leaves, spec=spec, lifted=lifted, feeds=feeds, positions=positions,
            names=self._feed_names(leaf_names, positions),
            static_names=[n for n, v in zip(leaf_names, leaves) if not isinstance(v, _Tensor)],
            key=(spec, statics, metas, training),
        )

    def _capture(self, call: Call, dynamic: list[dict[int, str | None]], variant: bool = False) -> Any:
        snapshots = [_snapshot(t) if isinstance(t, _Tensor) else None for t in call.feeds]
        out = self._target(*call.args, **call.kwargs)  # the target's own exceptions reach the caller unchanged
        mutated = [n for n, t, s in zip(call.names, call.feeds, snapshots) if s is not None and _mutated(t, s)]
        if mutated:
            why = f"input mutation: the call modified input(s) {mutated} in place, which a graph cannot reproduce"
            return self._give_up(why, call.args, call.kwargs, result=out)
        self._check_output_axes(out, call)
        try:
            capture = self._build(call, dynamic, out)
        except CaptureError as e:
            try:
                call, capture = self._degrade(call, dynamic, out, e)
            except CaptureError as final:
                return self._give_up(f"capture failed: {final}", call.args, call.kwargs, result=out, cause=final)
        if call.lifted:
            self._lifted[call.spec] = call.lifted
        else:
            self._lifted.pop(call.spec, None)
        kept = self._captures.get(call.key, []) if variant else []
        self._captures[call.key] = (kept + [capture])[-_VARIANTS:]
        self._touch(capture)
        while len(self._captures) > max(1, config.cache_size):
            self._captures.popitem(last=False)
        self._last_key = call.key
        self._state = _COMPILED
        return out

    def _degrade(self, call: Call, dynamic: list[dict[int, str | None]], out: Any, error: CaptureError) -> tuple[Call, Any]:
        """Retry a failed capture asking less of the exporter: lifted numbers baked, then the axes
        that only drift made dynamic exported static. Each step is recorded; the last error is raised."""
        if call.lifted:
            lifted_names = [n for n, p in zip(call.names, call.positions) if p in call.lifted]
            self._unliftable[call.spec] = self._unliftable.get(call.spec, frozenset()) | call.lifted
            self._note(f"numbers {lifted_names} stay baked: the exporter could not lift them ({_first_line(error)})")
            call = self._call(call.args, call.kwargs, call.leaves, call.spec, frozenset())
            dynamic = self._initial_dynamic(call)
            try:
                return call, self._build(call, dynamic, out)
            except CaptureError as e:
                error = e
        declared = self._declared_axes(call)
        learned = [(n, a) for n, d, k in zip(call.names, dynamic, declared) for a in d if a not in k]
        if not learned:
            raise error
        self._static_axes |= set(learned)
        self._note(f"axes {learned} could not be exported dynamic ({_first_line(error)}); captured them static")
        return call, self._build(call, declared, out)

    def _build(self, call: Call, dynamic: list[dict[int, str | None]], out: Any) -> capture_mod.Capture:
        request = capture_mod.CaptureRequest(
            target=self._target, owner=self._owner, leaves=call.leaves, spec=call.spec,
            has_kwargs=bool(call.kwargs), feed_positions=call.positions, feed_names=call.names, dynamic=dynamic, eager_out=out,
            graph_name=self._graph_name, output_names=self._output_names, output_dims=self._output_axes,
            optimize=self._optimize, place=self._place_for(call.feeds), key=call.key, lifted=call.lifted,
            parameters=self._forms.positional,
        )
        with torch.inference_mode(False), torch.no_grad():
            return capture_mod.build(request)

    def _touch(self, capture: capture_mod.Capture) -> None:
        self._current = capture
        self._flat_hit = capture.flat_hit
        try:
            self._captures.move_to_end(capture.key)
        except KeyError:  # evicted meanwhile by another thread's capture
            pass

    def _record(self, reasons: Sequence[str]) -> None:
        reason = "; ".join(reasons)
        logger.info("re-capture of %s: %s", self.__name__, reason)
        self._reasons.append(reason)

    def _note(self, note: str) -> None:
        logger.info("capture of %s: %s", self.__name__, note)
        self._notes.append(note)

    def _give_up(self, why: str, args: tuple, kwargs: dict, *, result: Any = None, run_eager: bool = False,
                 cause: Exception | None = None) -> Any:
        """Fallback to eager with a warning that says why; ``fullgraph=True`` raises instead."""
        if self._fullgraph:
            raise CaptureError(f"{self.__name__}: {why}") from cause
        self._fallback(why)
        return self._target(*args, **kwargs) if run_eager else result

    def _fallback(self, why: str, warn: bool = True) -> None:
        self._state = State.Fallback
        self._flat_hit = None
        self._fallback_why = why
        logger.log(logging.WARNING if warn else logging.INFO, "%s serves eagerly until reset(): %s", self.__name__, why)
        if warn:
            warnings.warn(f"clika_runtime: {self.__name__} serves eagerly until reset(): {why}", stacklevel=_user_level())

    def _unhashable(self, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        bad = [type(v).__name__ for v in leaves if not isinstance(v, _Tensor) and not _hashable(v)]
        why = f"static input leaf of unhashable type {bad[0] if bad else '?'} cannot key a capture"
        if self._fullgraph:
            raise CaptureError(f"{self.__name__}: {why}; pass it as a tensor or a hashable value")
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"clika_runtime: {self.__name__}: {why}; serving this call eagerly", stacklevel=_user_level())
        return self._target(*args, **kwargs)

    # ----------------------------------------------------------------------------- capture planning

    def _leaf_names(self, args: tuple, kwargs: dict, leaves: list[Any]) -> list[str]:
        """A name per leaf from the parameter name and pytree path (``x``, ``batch_input_ids``)."""
        names = []
        for path in trees.leaf_paths((args, kwargs), leaves):
            head = self._forms.argument_name(int(path[1])) if path[0] == "0" else path[1]
            names.append(trees.identifier((head, *path[2:]), "input"))
        return names

    def _feed_names(self, leaf_names: list[str], positions: list[int]) -> list[str]:
        names = [leaf_names[p] for p in positions]
        declared = [s.name for s in self._signature]
        if len(declared) == len(names):
            names = [d or n for d, n in zip(declared, names)]
        return trees.unique(names)

    def _check_signature(self, call: Call) -> None:
        """A call that breaks the declared signature or declared dim names raises before anything runs."""
        tensors = [(n, t) for n, t in zip(call.names, call.feeds) if isinstance(t, _Tensor)]
        declared: list[tuple[str, int, str]] = []  # (input, axis, dim name) declared by name
        if self._signature:
            if len(tensors) != len(self._signature):
                raise SignatureError(
                    f"signature declares {len(self._signature)} tensor inputs, the call has {len(tensors)}: "
                    f"{[n for n, _ in tensors]}"
                )
            for (name, t), spec in zip(tensors, self._signature):
                if spec.dtype is not None and t.dtype != spec.dtype:
                    raise SignatureError(f"input '{name}': expected dtype {spec.dtype}, got {t.dtype}")
                if t.dim() != len(spec.shape):
                    raise SignatureError(
                        f"input '{name}': expected rank {len(spec.shape)} {list(spec.shape)}, got shape {tuple(t.shape)}"
                    )
                for axis, (want, got) in enumerate(zip(spec.shape, t.shape)):
                    if isinstance(want, int) and want != got:
                        raise SignatureValueError(
                            f"input '{name}' axis {axis}: expected size {want} {list(spec.shape)}, got {got}"
                        )
                declared += [(name, a, d) for a, d in enumerate(spec.shape) if isinstance(d, str)]
        shapes = dict(tensors)
        for name, axes in self._dynamic_axes.items():
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

    def _initial_dynamic(self, call: Call) -> list[dict[int, str | None]]:
        """Dynamic axes of a new key's first capture: declared ones, with ``dynamic=True`` every
        axis, with ``dynamic=None`` those earlier drift taught about the same input."""
        previous = dict(zip(self._current.feed_names, self._current.dynamic)) if self._current else {}
        dynamic = []
        for name, value, declared in zip(call.names, call.feeds, self._declared_axes(call)):
            axes: dict[int, str | None] = {}
            if isinstance(value, _Tensor) and self._dynamic is True:
                axes = {a: None for a in range(value.dim())}
            elif isinstance(value, _Tensor) and self._dynamic is None:
                axes = {a: n for a, n in previous.get(name, {}).items() if a < value.dim()}
            dynamic.append(self._without_static({**axes, **declared}, name, declared))
        return dynamic

    def _declared_axes(self, call: Call) -> list[dict[int, str | None]]:
        """Per fed leaf, the axes the user declared dynamic (signature, dynamic_axes); a lifted
        number is declared dynamic by being lifted."""
        n_tensors = sum(isinstance(t, _Tensor) for t in call.feeds)
        specs = iter(self._signature if len(self._signature) == n_tensors else ())
        declared = []
        for name, value, pos in zip(call.names, call.feeds, call.positions):
            if not isinstance(value, _Tensor):
                declared.append({0: None} if pos in call.lifted else {})
                continue
            axes: dict[int, str | None] = {}
            spec = next(specs, None)
            if spec is not None:
                axes.update({a: d for a, d in enumerate(spec.shape) if not isinstance(d, int)})
            axes.update({a: d for a, d in self._dynamic_axes.get(name, {}).items() if a < value.dim()})
            declared.append(axes)
        return declared

    def _without_static(self, axes: dict[int, str | None], name: str, declared: dict[int, str | None]) -> dict[int, str | None]:
        """Drop axes the exporter could not make dynamic before (declared axes are always asked)."""
        return {a: n for a, n in axes.items() if a in declared or (name, a) not in self._static_axes}

    def _check_output_axes(self, out: Any, call: Call) -> None:
        """``dynamic_axes`` names that are neither inputs nor outputs: an error listing both."""
        unknown = set(self._dynamic_axes) - set(call.names)
        if not unknown:
            return
        leaves = _flatten(out)[0]
        outputs = self._output_names or trees.output_names(out, leaves)
        unknown -= set(outputs)
        if unknown:
            raise SignatureValueError(
                f"dynamic_axes: {sorted(unknown)} match no input or output; inputs: {call.names}, outputs: {list(outputs)}"
            )

    @property
    def _output_axes(self) -> dict[str, dict[int, str | None]]:
        inputs = set(self._current.feed_names) if self._current else set()
        return {n: a for n, a in self._dynamic_axes.items() if n not in inputs}

    def _initial_lift(self, spec: Any, leaves: list[Any]) -> frozenset[int]:
        if self._specialize is False:
            unliftable = self._unliftable.get(spec, frozenset())
            return frozenset(i for i, v in enumerate(leaves) if type(v) is int and i not in unliftable)
        return _NO_LIFT

    def _lift_changed_numbers(self, call: Call) -> tuple[frozenset[int], list[str]]:
        """``specialize=None``: an int whose value changed since the last capture becomes a graph input.

        Floats stay baked: torch.export specialises Python floats, so lifting them cannot export.
        """
        last = self._last_key
        if self._specialize is not None or last is None or last[0] != call.spec or last[3] != call.key[3]:
            return call.lifted, []
        statics = [i for i, v in enumerate(call.leaves) if not isinstance(v, _Tensor)]
        unliftable = self._unliftable.get(call.spec, frozenset())
        changed = []
        for i, name, old in zip(statics, call.static_names, last[1]):
            value = call.leaves[i]
            if i not in unliftable and type(value) is int and isinstance(old, tuple) and old[0] is int and old[1] != value:
                changed.append((i, name, old[1], value))
        if not changed:
            return call.lifted, []
        reasons = [f"static value changed: '{n}' {a} -> {b}; it becomes a graph input" for _, n, a, b in changed]
        return call.lifted | {i for i, *_ in changed}, reasons

    def _place_for(self, feeds: list[Any]) -> serving.Place:
        if self._place is not None:
            place = self._place
        else:
            cuda = next((t.device for t in feeds if isinstance(t, _Tensor) and t.device.type == "cuda"), None)
            place = _resolve_place(str(cuda) if cuda is not None and serving.cuda_available() else "cpu")
        return serving.with_torch_stream(place)


# ---------------------------------------------------------------------------------------- helpers

def _user_level() -> int:
    """The ``stacklevel`` that points a warning at the user's call, past our own frames."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("clika_runtime"):
        frame, level = frame.f_back, level + 1
    return level


def _snapshot(t: torch.Tensor) -> Any:
    """What to compare after the eager call to tell whether it mutated ``t`` in place."""
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: compare their bytes instead
        return t.detach().clone()


def _mutated(t: torch.Tensor, snapshot: Any) -> bool:
    if isinstance(snapshot, int):
        return t._version != snapshot
    return t.shape != snapshot.shape or not torch.equal(_bytes(t), _bytes(snapshot))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Bytes, not values: NaN != NaN would read as a mutation.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _has_dynamic(spec: TensorSpec) -> bool:
    return any(not isinstance(d, int) for d in spec.shape)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
        return True
    except TypeError:
        return False


def _owner_module(target: Any) -> torch.nn.Module | None:
    if isinstance(target, torch.nn.Module):
        return target
    owner = getattr(target, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _default_name(target: Any) -> str:
    if isinstance(target, torch.nn.Module):
        return type(target).__name__
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__


def _resolve_place(place: PlaceLike) -> serving.Place:
    try:
        return serving.resolve(place)
    except ValueError as e:
        raise PlaceError(str(e)) from e


def _normalise_axes(axes: DynamicAxes) -> dict[str, dict[int, str | None]]:
    out: dict[str, dict[int, str | None]] = {}
    for name, spec in axes.items():
        if isinstance(spec, Mapping):
            out[name] = {int(a): (str(n) if n else None) for a, n in spec.items()}
        else:
            out[name] = {int(a): None for a in spec}
    return out
