"""The default exporter: ``torch.onnx.export(..., dynamo=True)`` (torch.export underneath)."""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import functools
import inspect
import linecache
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir
import torch
from torch.export import Dim

from exporters import conditions as conds
from exporters import (
    exact_rewrites,
    fast_paths,
    fusion,
    graph_edits,
    integers,
    log_domain,
    nan_guard,
    sizes,
    translations,
    transposes,
)
from exporters.dtypes import onnx_dtype
from exporters.other_threads import InOtherThread, held
from exporters.quiet import quiet

_GRAPH_SCALARS = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
# torch.export keeps process-wide tracing state: two exports at once (two threads capturing
# different keys) corrupt each other, so exports take turns.
_EXPORTING = threading.Lock()
# The name torch.fx gives the source of each GraphModule it compiles (see `_fx_sources_dropped`).
_FX_SOURCE = "<eval_with_key>"


@dataclass
class ExportedGraph:
    """What one export produced.

    Attributes:
        model: the graph (an ``onnx_ir.Model``: its weights still view the module's tensors, so
            nothing is copied until it is saved; ``save`` writes it), inputs, outputs and dims named.
        input_dims: per graph input, each axis as an int (static) or its dim name (dynamic).
        graph_leaves: positions, in the flat output of ``fn``, of the leaves the graph computes.
        constants: the other output leaves, by position, as traced (baked into the capture).
        dim_ranges: dim name -> (lowest, highest or None) size the exporter assumed.
        number_ranges: input index -> (lowest, highest or None) value, for Python-number inputs
            the graph takes as inputs.
        specialized: indices of Python-number inputs the exporter baked in (a constant in the
            graph despite being an input): serving those from the graph would be wrong.
        conditions: size conditions the trace branched on that the graph does not check, as
            trees (see ``exporters.conditions``); only those that read a dynamic size or a
            lifted number.
        opaque: dynamic (input, axis) pairs (axis ``None``: a lifted number) read by conditions
            that cannot be expressed as trees: they must be exported static.
        state: the owner's parameters and buffers the graph holds, by their name in the owner
            (the live tensor objects, not copies).
        constants_read: other tensors the trace read and the graph holds (closed-over tensors,
            plain tensor attributes), by the exporter's name for them (the live objects).
    """

    model: ir.Model
    input_dims: list[tuple[int | str | None, ...]]
    graph_leaves: list[int]
    constants: dict[int, Any]
    dim_ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    number_ranges: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    specialized: list[int] = field(default_factory=list)
    conditions: list[tuple] = field(default_factory=list)
    opaque: set[tuple[int, int | None]] = field(default_factory=set)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    constants_read: dict[str, torch.Tensor] = field(default_factory=dict)


class _Flat(torch.nn.Module):
    """Calls ``fn`` on flat inputs and returns only the leaves a graph can compute.

    Non-graph leaves (constant ints, strings, None) are recorded at trace time instead: the ONNX
    converter cannot return them, and they are the same for every call the capture serves.
    """

    def __init__(self, fn: Callable[..., Sequence[Any]], owner: torch.nn.Module | None) -> None:
        super().__init__()
        self.fn = fn
        # Registering the module the target belongs to makes its weights graph initializers.
        self.owner = owner
        # Not .train()/.eval(): those would change the owner's mode too.
        self.training = owner.training if owner is not None else False
        # The exporter may work on a deep copy of this module: the plan lives in a closure, which
        # copying shares, rather than in module attributes, which it would copy.
        plan: dict[str, Any] = {"graph_leaves": [], "constants": {}}
        self.plan = lambda: plan

    def forward(self, *args: Any) -> tuple[Any, ...]:
        leaves = list(self.fn(*args))
        graph_leaves = [i for i, v in enumerate(leaves) if isinstance(v, _GRAPH_SCALARS)]
        plan = self.plan()
        plan["graph_leaves"] = graph_leaves
        plan["constants"] = {i: v for i, v in enumerate(leaves) if not isinstance(v, _GRAPH_SCALARS)}
        return tuple(leaves[i] for i in graph_leaves)


def _dynamic_shapes(examples: Sequence[Any], dynamic: Sequence[Mapping[int, Any]]) -> tuple:
    # Dim.AUTO, not Dim.DYNAMIC or named Dims: an axis the model forces static (a reshape to a
    # constant, a matmul with a weight) is exported static instead of failing the export; the
    # guard then keeps it static, and user-declared equal names are enforced by the guard too.
    specs = []
    for value, axes in zip(examples, dynamic):
        if isinstance(value, torch.Tensor):
            specs.append({axis: Dim.AUTO for axis in axes} or None)
        else:  # a lifted Python number: dynamic when asked, else baked
            specs.append(Dim.AUTO if axes else None)
    return (tuple(specs),)


def _onnx_program(
    flat: torch.nn.Module, examples: tuple, input_names: list[str], dynamic_shapes: Any, optimize: bool
) -> Any:
    """``torch.onnx.export(flat, examples, dynamo=True, ...)``, with its operator registry built once
    and our translations (``exporters.translations``) ahead of torchlib's.

    torch.onnx.export rebuilds the registry of ONNX functions on every call: half a second, about
    half of a small model's capture. The registry is only read during an export, so the call
    below is the one ``torch.onnx.export`` makes, with one registry kept for the process; where
    that private entry point is not there (another torch), the public call is made instead.
    """
    exact_rewrites.exact()
    cached = _exporter_with_registry()
    if cached is None:
        program = torch.onnx.export(
            flat, examples, dynamo=True, input_names=input_names, dynamic_shapes=dynamic_shapes,
            optimize=False, verbose=False, custom_translation_table=translations.TABLE,
        )
    else:
        export, registry, opset = cached
        program = export(
            flat, examples, None, registry=registry, dynamic_shapes=dynamic_shapes, input_names=input_names,
            verbose=False, optimize=False, opset_version=opset,
        )
    sizes.as_doubles(program.model.graph)  # before anything reads the types the exporter declared
    if optimize:
        program.optimize()
    return program


@functools.cache
def _exporter_with_registry() -> tuple[Callable[..., Any], Any, int] | None:
    try:
        from torch.onnx import _constants as onnx_constants
        from torch.onnx._internal.exporter import _constants, _core, _registration
    except ImportError:
        return None
    if "registry" not in inspect.signature(_core.export).parameters:
        return None
    opset = onnx_constants.ONNX_DEFAULT_OPSET  # torch.onnx.export's default, as in its own body
    registry = _registration.ONNXRegistry().from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))
    for target, function in translations.TABLE.items():
        registry.register_op(target, function)
    return _core.export, registry, opset


def root_cause(error: BaseException) -> str:
    """The innermost cause of an exporter failure, first lines only: what a user can act on."""
    error = _innermost(error)
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()][:6]
    return f"{type(error).__name__}: " + "\n".join(lines)


def _interrupt_under(error: BaseException) -> BaseException | None:
    """A ``KeyboardInterrupt`` (or ``SystemExit``) that the exporter's own handling turned into
    another error: torch's ``except torch._dynamo.exc.UserError`` while ``torch._dynamo`` is half
    imported (a Ctrl-C during the process's first export) raises ``AttributeError`` over it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if not isinstance(error, Exception):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _innermost(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def export_graph(
    fn: Callable[..., Sequence[Any]],
    examples: Sequence[Any],
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    output_dtypes: Sequence[torch.dtype | None],
    dynamic: Sequence[Mapping[int, str | None]],
    graph_name: str,
    output_dims: Mapping[str, Mapping[int, str | None]] | None = None,
    optimize: bool = True,
    owner: torch.nn.Module | None = None,
    guard_nan: bool = True, parked: Callable[[int], bool] | None = None,
) -> ExportedGraph:
    """Export ``fn(*examples) -> flat output leaves`` to ONNX with torch.export.

    Args:
        fn: takes the flat inputs positionally, returns the flat output leaves.
        examples: one example per input (tensors, or Python numbers lifted to graph inputs).
        input_names: the graph input names.
        output_names / output_dtypes: per output leaf of ``fn`` (dtype ``None`` for sizes: int64);
            only leaves the graph computes become outputs, cast back to these dtypes when the
            exporter changed them.
        dynamic: per input, the axes to leave dynamic, each with a dim name or ``None`` (named
            after the first input and axis that carry it). The exporter may prove some static.
        graph_name: the ONNX graph's name.
        output_dims: per output name, axes to name (``None``: the default name); naming only: an
            output's dims are dynamic exactly when the graph computes them from dynamic inputs.
        optimize: run the exporter's portable optimisations (constant folding, dead code).
        owner: the module whose weights the graph carries, if any.
        guard_nan: serve max pools bare unless a NaN reaches them (``nan_guard``): for CPU graphs;
            on CUDA the guard's ``If`` would copy its condition to the host on every run.
        parked: whether a thread (by id) waits on the caller: the export does not wait for it (``held``).

    Raises:
        RuntimeError: the exporter failed; the message holds its root cause.
    """
    program = _exported(flat := _Flat(fn, owner), examples, input_names, dynamic, optimize, owner, parked)
    numbers = _numbers(program.exported_program, examples)
    number_symbols = {symbol: input_names[i] for symbol, i in numbers.pop("symbols").items()}
    graph_leaves = flat.plan()["graph_leaves"]
    derived = conds.derived_dims(program.exported_program)
    model, renames = _edited(program, input_names, [output_names[i] for i in graph_leaves],
                             [_leaf_dtype(output_dtypes[i]) for i in graph_leaves], dynamic, output_dims or {},
                             graph_name, examples, number_symbols, guard_nan, derived)
    input_dims = graph_edits.input_dims(model)
    trees, opaque, reads = _conditions(program.exported_program, input_dims, examples, numbers["specialized"])
    trees += derived.values()  # the relations the guard checks instead of pinning those dims
    return ExportedGraph(
        model=model,
        input_dims=input_dims,
        graph_leaves=list(graph_leaves),
        constants=dict(flat.plan()["constants"]),
        dim_ranges=_ranges(program.exported_program, renames),
        conditions=conds.relevant(trees, reads),
        opaque=opaque & reads,
        state=_owned(program.exported_program.state_dict),
        constants_read=_owned(program.exported_program.constants),
        **numbers,
    )


def _exported(flat: _Flat, examples: Sequence[Any], input_names: Sequence[str], dynamic: Sequence[Mapping[int, Any]],
              optimize: bool, owner: torch.nn.Module | None, parked: Callable[[int], bool] | None) -> Any:
    """The exporter's program; its failures as one ``RuntimeError`` with the root cause, a trace
    that writes buffers as ``WritesState``."""
    try:
        with _EXPORTING, held(flat, parked), quiet(), _fx_sources_dropped(), _tracer_patches_in_this_thread(flat), \
                _inference_parameters_frozen(owner), fast_paths.encoders_as_in_eager(owner):
            # In a copy of the context: every `config.patch(...)` torch enters makes a ContextVar
            # of its own, which stays in the context that set it for good (5 a capture); in a
            # copy, they go with it. The patches restore their values on exit, so nothing else
            # the export sets is meant to outlive it.
            program = contextvars.copy_context().run(
                _onnx_program,
                flat, tuple(examples), list(input_names), _dynamic_shapes(examples, dynamic) if examples else None, optimize
            )
    except Exception as e:  # the exporter raises many unrelated types; the cause is what matters
        interrupt = _interrupt_under(e)
        if interrupt is not None:
            raise interrupt from None
        if isinstance(_innermost(e), InOtherThread):
            raise Uncapturable(str(_innermost(e))) from e
        raise RuntimeError(root_cause(e)) from e
    _tensors_forgotten(program.exported_program)
    _refuse_state_writes(program.exported_program, owner)
    _refuse_random(program.exported_program, owner)
    return program


@contextlib.contextmanager
def _inference_parameters_frozen(owner: torch.nn.Module | None) -> Iterator[None]:
    """While the block runs, parameters that are inference tensors (a model converted under
    ``torch.inference_mode()``: ``.half()``, ``.to(device)``) do not require grad: torch.export
    sets the flag on its copies again, which torch refuses for inference tensors outside
    inference mode. Their flag is put back after, in inference mode, where torch allows it."""
    lowered = [p for p in owner.parameters() if p.requires_grad and p.is_inference()] if owner is not None else []
    for p in lowered:
        p.requires_grad_(False)
    try:
        yield
    finally:
        with torch.inference_mode():
            for p in lowered:
                p.requires_grad_(True)


@contextlib.contextmanager
def _tracer_patches_in_this_thread(traced: torch.nn.Module) -> Iterator[None]:
    """While the block runs, what torch.fx's tracer patches for the whole process
    (``nn.Module.__call__`` and ``__getattr__``, the functions it wraps) acts in this thread only.

    The tracer keeps one stack of the module calls it is in, and the trace holds the traced
    modules' parameters: a module called from another thread meanwhile went through this trace
    (``generate`` calling its encoder while another thread's call captures the decoder), and both
    the export and that call failed on the stack (an AssertionError). In other threads, modules
    and everything else patched run as without the trace (``other_threads.held`` makes calls of
    ``traced``'s modules wait for the export to end)."""
    patcher = getattr(getattr(torch.fx, "_symbolic_trace", None), "_Patcher", None)
    if patcher is None:  # another torch: its tracer as it is
        yield
        return
    patch_method, patch = patcher.patch_method, patcher.patch
    here = threading.get_ident()

    def method_here(self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        return patch_method(self, cls, name, _here_only(here, getattr(cls, name), new_fn), deduplicate)

    def global_here(self: Any, frame_dict: dict, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        original = frame_dict.get(name, getattr(builtins, name, None))
        return patch(self, frame_dict, name, new_fn if original is None else _here_only(here, original, new_fn),
                     deduplicate)

    patcher.patch_method, patcher.patch = method_here, global_here
    try:
        yield
    finally:
        patcher.patch_method, patcher.patch = patch_method, patch


def _here_only(thread: int, original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    def patched(*args: Any, **kwargs: Any) -> Any:
        return (replacement if threading.get_ident() == thread else original)(*args, **kwargs)

    return patched


def _tensors_forgotten(program: Any) -> None:
    """Drop the weak references the export's fake tensor mode keeps to the real tensors it
    described (the parameters, the example inputs). The mode outlives the export (torch's and
    onnxscript's globals keep its last trace reachable), and ``torch.utils.swap_tensors`` refuses
    a tensor with a weak reference: ``model.to(...)`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` raised after a capture. The
    trace is done with them; only its lookups from a real tensor to its description go."""
    modes = {id(mode): mode for node in program.graph.nodes
             if (mode := getattr(node.meta.get("val"), "fake_mode", None)) is not None}
    for mode in modes.values():
        describer = getattr(getattr(getattr(mode, "fake_tensor_converter", None), "meta_converter", None),
                            "describer", None)
        for lookup in (getattr(describer, "lookup_tensor", None), getattr(describer, "lookup_storage", None)):
            if lookup is not None:
                lookup.clear()


@contextlib.contextmanager
def _fx_sources_dropped() -> Iterator[None]:
    """Forget the generated source of the GraphModules made inside the block.

    torch.fx keeps the source of every GraphModule it compiles for good, for tracebacks: one entry
    in ``linecache`` and one string in its loader's ``eval_cache``. An export compiles about 19,
    so a process that re-captures grew by ~26 KiB a capture, forever. The modules an export makes
    are not run after it (the graph is read, the program is ONNX), so their sources are dropped.
    Only names this block added go; a GraphModule another thread compiles meanwhile loses its
    source lines in tracebacks, nothing else.
    """
    loader = getattr(getattr(torch.fx, "graph_module", None), "_loader", None)
    sources: dict[str, str] = getattr(loader, "eval_cache", {})
    before_lines, before_sources = set(linecache.cache), set(sources)
    try:
        yield
    finally:
        # set(dict) copies in one C call: another thread's traceback may fill linecache meanwhile.
        for name in _added(set(linecache.cache) - before_lines):
            linecache.cache.pop(name, None)
        for name in _added(set(sources) - before_sources):
            sources.pop(name, None)


def _added(names: set[str]) -> list[str]:
    return [name for name in names if name.startswith(_FX_SOURCE)]


class Uncapturable(RuntimeError):
    """What the traced function does cannot be served from a graph, however it is exported."""


class WritesState(Uncapturable):
    """The traced function writes its module's buffers (``self.last.copy_(x)``, a training-mode
    batch norm's running statistics) or parameters (``nn.Embedding(max_norm=...)``): a graph
    returns outputs only, so served calls would skip the writes."""


class DrawsRandom(Uncapturable):
    """The traced function draws random numbers (``torch.rand``, ``multinomial``, training-mode
    dropout): onnxruntime's generator would draw them, deaf to ``torch.manual_seed``, and one
    verification against eager cannot tell a lucky draw from a right graph."""


def _refuse_random(program: Any, owner: torch.nn.Module | None) -> None:
    drawn = sorted({str(node.target) for node in program.graph.nodes if node.op == "call_function" and _draws(node)})
    if not drawn:
        return
    training = owner is not None and owner.training
    raise DrawsRandom(
        f"the target draws random numbers ({', '.join(drawn)}), which a graph cannot draw from torch's generator"
        + (" (a training-mode module: call .eval() before serving)" if training else ""))


def _draws(node: torch.fx.Node) -> bool:
    """Whether the node draws random numbers. torch tags every op that may draw; attention and
    dropout draw only with a dropout probability above 0 in training mode."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    arguments = target._schema.arguments
    bound = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
             for i, a in enumerate(arguments)}
    if "train" in bound and bound["train"] is False:  # dropout ops in eval mode
        return False
    probability = bound.get("dropout_p", bound.get("p") if "train" in bound else None)
    return not (isinstance(probability, (int, float)) and probability == 0)


def _refuse_state_writes(program: Any, owner: torch.nn.Module | None) -> None:
    buffers = sorted(set(program.graph_signature.buffers_to_mutate.values()))
    parameters = sorted(_written_in_place(program))
    if not buffers and not parameters:
        return
    names = [n.removeprefix("owner.") for n in buffers]  # the owner's own names (see `_owned`)
    what = " and ".join(part for part in (f"buffer(s) {names}" if names else "",
                                          f"parameter(s) {[n.removeprefix('owner.') for n in parameters]}"
                                          if parameters else "") if part)
    training = owner is not None and owner.training
    raise WritesState(
        f"the target writes {what} in place, which served calls would skip"
        + (" (a training-mode module updates its statistics: call .eval() before serving)" if training
           else " (keep the write out of the compiled function, or return the new value instead)"))


def _written_in_place(program: Any) -> set[str]:
    """Parameters the trace writes in place, each as ``name (op)``: ``nn.Embedding(max_norm=...)``
    renormalises the rows it looks up, on every call (``embedding_renorm``)."""
    mutated = getattr(program.graph_signature, "parameters_to_mutate", None) or {}
    if not mutated:
        return set()
    ops = {node.name: str(getattr(node.target, "__name__", node.target)).split(".")[0] for node in program.graph.nodes}
    return {f"{name} ({ops.get(output, output)})" for output, name in mutated.items()}


def _edited(
    program: Any, input_names: Sequence[str], output_names: Sequence[str], output_dtypes: Sequence[ir.DataType],
    dynamic: Sequence[Mapping[int, str | None]], output_dims: Mapping[str, Mapping[int, str | None]],
    graph_name: str, examples: Sequence[Any], number_symbols: Mapping[str, str], guard_nan: bool,
    derived: Mapping[tuple[int, int], tuple],
) -> tuple[ir.Model, dict[str, str]]:
    """The exported model with our names, eager's output dtypes and static dims where the
    exporter pinned them (or wrote an expression ``derived`` has no condition for); also the
    symbol -> dim name renames applied."""
    model = program.model
    graph_edits.name_inputs(model, input_names)
    graph_edits.fix_outputs(model, output_names, output_dtypes)
    graph_edits.pin_dims(model, _pinned(program.exported_program))
    graph_edits.pin_derived_inputs(model, examples, derived)
    graph_edits.widen_indices(model)
    integers.exact(model)
    transposes.fold_key_transposes(model.graph)
    log_domain.logs_of_sigmoids(model.graph)
    declared = [{a: n for a, n in axes.items() if n} for axes in dynamic]
    renames = graph_edits.name_dims(model, declared, output_dims, number_symbols)
    if guard_nan:
        nan_guard.guard_nan_pools(model.graph)  # last: the exact branch is the graph as named above
    model.graph.name = graph_name
    return model, renames


def _conditions(
    program: Any, input_dims: Sequence[tuple], examples: Sequence[Any], specialized: Sequence[int]
) -> tuple[list[tuple], set[tuple[int, int | None]], set[tuple[int, int | None]]]:
    """The dead size conditions of the trace, the inputs read by those it cannot express, and
    the dynamic sizes and lifted numbers a condition may read."""
    reads = {(i, a) for i, dims in enumerate(input_dims) for a, d in enumerate(dims) if not isinstance(d, int)}
    reads |= {(i, None) for i, v in enumerate(examples) if not isinstance(v, torch.Tensor)} - {
        (i, None) for i in specialized
    }
    trees, opaque = conds.dead_conditions(program)
    return trees, opaque, reads


def outputs(exported: ExportedGraph) -> list[tuple[str, str, tuple[int | str, ...]]]:
    """Each graph output's name, dtype name (numpy's, or "bfloat16") and dims (int or dim name)."""
    found = []
    for value in exported.model.graph.outputs:
        dims = tuple(d if isinstance(d, int) else str(d.value) for d in value.shape or ())
        found.append((value.name, _dtype_name(value.dtype), dims))
    return found


def model_bytes(exported: ExportedGraph) -> int:
    """The bytes of the weights the graph holds."""
    return sum(v.const_value.nbytes for v in exported.model.graph.initializers.values() if v.const_value is not None)


def save(exported: ExportedGraph, path: str, metadata: Mapping[str, str], external_above: int) -> None:
    """Write the graph (with ``metadata`` in its ``metadata_props``) to ``path``; weights past
    ``external_above`` bytes go to ``<path>.data`` beside it, and the model's initializers then
    refer to that file (a fused graph made from the model afterwards shares it). Tensors stream
    from the module's memory to the file: no serialized copy of the weights is ever made."""
    model = exported.model
    model.metadata_props.update(metadata)
    if model_bytes(exported) > external_above:
        fusion.externalize(model, path)
    else:
        ir.save(model, path)


def _dtype_name(dtype: ir.DataType | None) -> str:
    if dtype is None:
        return "unknown"
    if dtype == ir.DataType.BFLOAT16:
        return "bfloat16"
    return dtype.numpy().name


def _owned(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The exporter's tensors by their name in the owner module (it registers it as ``owner``)."""
    return {
        name.removeprefix("owner."): value for name, value in tensors.items() if isinstance(value, torch.Tensor)
    }


def _leaf_dtype(dtype: torch.dtype | None) -> ir.DataType:
    # Non-tensor graph leaves without a dtype are sizes (SymInt): ONNX carries them as int64 scalars.
    return ir.DataType.INT64 if dtype is None else onnx_dtype(dtype)


def _ranges(program: Any, renames: Mapping[str, str]) -> dict[str, tuple[int, int | None]]:
    ranges: dict[str, tuple[int, int | None]] = {}
    for symbol, bounds in getattr(program, "range_constraints", {}).items():
        name = renames.get(str(symbol))
        if name is None:
            continue
        lower, upper = bounds.lower, bounds.upper
        hi = None if upper is None or not _finite(upper) else int(upper)
        ranges[name] = (int(lower) if _finite(lower) else 0, hi)
    return ranges


def _pinned(program: Any) -> dict[str, int]:
    """Symbols the exporter's ranges pin to a single value: static in truth."""
    return {
        str(symbol): int(bounds.lower)
        for symbol, bounds in getattr(program, "range_constraints", {}).items()
        if _finite(bounds.lower) and bounds.lower == bounds.upper
    }


def _numbers(program: Any, examples: Sequence[Any]) -> dict[str, Any]:
    """Which Python-number inputs stayed symbolic, and their value ranges."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"}
    values = [n.meta.get("val") for n in placeholders if n.name in user]
    ranges: dict[int, tuple[int, int | None]] = {}
    specialized: list[int] = []
    symbols: dict[str, int] = {}  # exporter symbol of a lifted number -> its input index
    for i, (example, value) in enumerate(zip(examples, values)):
        if isinstance(example, torch.Tensor):
            continue
        expr = value.node.expr if isinstance(value, torch.SymInt) else None
        if expr is None or expr.is_number:
            specialized.append(i)
            continue
        if expr.is_symbol:
            symbols[str(expr)] = i
        bounds = program.range_constraints.get(expr)
        if bounds is not None and bounds.lower == bounds.upper:  # pinned to one value: baked in effect
            specialized.append(i)
        elif bounds is not None:
            hi = int(bounds.upper) if _finite(bounds.upper) else None
            ranges[i] = (int(bounds.lower) if _finite(bounds.lower) else -(2**63), hi)
    return {"number_ranges": ranges, "specialized": specialized, "symbols": symbols}


def _finite(bound: Any) -> bool:
    try:
        return math.isfinite(float(bound))
    except (TypeError, ValueError):
        return False
