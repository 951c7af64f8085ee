"""Serving a shipped graph: ``load`` and ``ServedGraph``, called like the function it was captured from.

Nothing here imports torch or onnx at module level: a deployment box with onnxruntime and numpy
serves a shipped graph with the same pytrees in and out, and enforces the same guard the
in-process capture enforced (sizes, ranges, size conditions, lifted-number ranges).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

import serving
from clika_runtime.base.config import config
from clika_runtime.base.precision import FP32, NON_FINITE, non_finite
from clika_runtime.base.errors import ClikaError, GraphFileError, GraphInputError, GraphRunError, PlaceError
from clika_runtime.base.saying import say
from clika_runtime.base.slots import KEYWORD, MISSING, slotted
from clika_runtime.base.specs import PlaceLike, TensorInfo, resolve_place
from clika_runtime.format import digest, graphfile, metadata, treedesc
from clika_runtime.format.graphfile import existing
from clika_runtime.guards.guard import Guard, InputRule
from clika_runtime.shipped.folder import GraphFolder


def load(path: str | os.PathLike, place: PlaceLike = None, *, output_types: Iterable[type] = (),
         verify_digest: bool = True) -> "ServedGraph":
    """Serve a shipped ``.onnx`` file (``ModelGraph.load(path).serve(place)``, without needing onnx).

    Graphs saved by clika_runtime take and return the captured pytrees; any other ONNX graph takes
    its inputs by name (or position) and returns ``{output name: value}``. numpy arrays in give
    numpy arrays out; torch tensors in give torch tensors out. Output trees are rebuilt with
    built-in containers, node types this process registered with torch's pytree (HuggingFace's
    ``ModelOutput`` when transformers is imported) and the classes in ``output_types``; a graph
    file never makes the library import a module or call any other class. A file whose tensors
    keep data outside its folder, or whose metadata does not describe its graph, is refused with
    ``GraphFileError`` before anything runs (docs/SECURITY.md). So is a file whose content is not
    the content its digest records (a changed weight, node or metadata: the message names which);
    ``verify_digest=False`` skips that check, for files verified another way. A file without a
    digest (saved before clika_runtime wrote them, or by another tool) loads, with an INFO log line.
    """
    return ServedGraph(str(existing(path)), place, output_types=output_types, verify_digest=verify_digest)


class ServedGraph:
    """A shipped graph served by onnxruntime, called like the function it was captured from."""

    def __init__(self, model: bytes | str, place: PlaceLike = None, *, output_types: Iterable[type] = (),
                 keep: Any = None, verify_digest: bool = True) -> None:
        self._keep = keep  # a temporary folder holding the model's external data, if any
        self._place = resolve_place(place)
        where = model if isinstance(model, str) else "graph"
        # Before onnxruntime opens it: what the file makes its reader read or run besides itself.
        if isinstance(model, str):
            model, copied = _checked_file(model, verify_digest)
            self._keep = copied or keep
        else:
            graphfile.check_serialized(model, where)
        self._session = _open(model, self._place, where)
        declared = read_session(self._session, where)
        self._declared = (declared.inputs, declared.outputs)
        self._types = treedesc.allowed_types(output_types)
        found, self._guard = metadata_and_guard(declared, where)
        _check_output_types(found, self._types, where)
        self._where = where
        self.input_names = [i.name for i in declared.inputs]
        self.output_names = [o.name for o in declared.outputs]
        self._inputs = found.inputs if found else None
        self._outputs = found.outputs if found else None
        self._parameters = found.parameters if found else []
        self._precision = found.precision.precision if found and found.precision else FP32
        self._numpy = serving.NumpyRunner(self._session, self.input_names, self.output_names)
        self._numpy_unfit = [o.name for o in declared.outputs if o.dtype == "bfloat16"]
        self._torch: Any = None
        self._dlpack = False  # whether the torch runner goes through DLPack (set with it)
        self._on_place = "is_cuda" if self._place.device == "cuda" else "is_cpu"  # the tensor attribute a call reads

    @property
    def providers(self) -> list[str]:
        """The onnxruntime providers the session really runs on."""
        return self._session.get_providers()

    @property
    def guard(self) -> Guard:
        """What this graph accepts (shipped with it, or read from its declared input shapes)."""
        return self._guard

    @property
    def inputs(self) -> list[TensorInfo]:
        """The graph's inputs as declared (name, dtype, shape), in input order."""
        return list(self._declared[0])

    @property
    def outputs(self) -> list[TensorInfo]:
        """The graph's outputs as declared (name, dtype, shape), in output order."""
        return list(self._declared[1])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs = self._checked_run(self._feeds(args, kwargs))
        if self._outputs is None:
            return dict(zip(self.output_names, outs))
        try:
            return treedesc.rebuild(self._outputs, iter(outs), self._types)
        except (TypeError, ValueError) as e:  # outputs that break what the file declared (a "number" of 3 values)
            raise GraphFileError(f"{self._where}: the outputs do not fit the output tree it describes: {e}") from e

    def run(self, feeds: Mapping[str, Any], /) -> dict[str, Any]:
        """Run on arrays given by graph input name; returns ``{output name: array}``.

        The flat form of a call, for servers that speak graph input names (the KServe v2 server):
        the guard of a call, without the captured pytrees.
        """
        missing = [n for n in self.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self.input_names]
        if missing or unknown:
            raise GraphInputError(f"graph inputs are {self.input_names}; missing {missing}, unknown {unknown}")
        return dict(zip(self.output_names, self._checked_run([feeds[n] for n in self.input_names])))

    def _checked_run(self, feeds: list[Any]) -> list[Any]:
        """Check the feeds (in input order) against the guard, then run; outputs in output order."""
        try:
            problem = self._guard.check(feeds)
        except RuntimeError:  # a tensor whose sizes torch will not give (a nested one): named if it is one
            _refuse_tensors(self.input_names, self._devices(), feeds)
            raise
        if problem is not None and problem.kind == "byteorder":  # native arrays never get here (see _native)
            feeds = _native(feeds)
            problem = self._guard.check(feeds)
        if problem is not None:
            raise GraphInputError(str(problem))
        try:
            at = non_finite(self._precision, feeds)
        except Exception:  # an int8 graph's reduction of a tensor that holds no values here (meta, sparse)
            _refuse_tensors(self.input_names, self._devices(), feeds)
            raise
        if at is not None:  # no eager here to answer instead: an error, not numbers that hide it
            raise GraphInputError(f"input '{self.input_names[at]}' {NON_FINITE}; serve the fp32 graph for such inputs")
        feeds = [np.asarray(v, dtype=np.int64) if r.shape is None else v for r, v in zip(self._guard.inputs, feeds)]
        is_torch = any(type(v).__module__.startswith("torch") for v in feeds)
        if not is_torch and self._numpy_unfit:
            raise GraphInputError(
                f"output(s) {self._numpy_unfit} are bfloat16, which numpy cannot hold: call with torch tensors"
            )
        try:
            return self._run_torch(feeds) if is_torch else self._numpy.run(feeds)
        except ClikaError:
            raise
        except Exception as e:  # onnxruntime's own types (Fail, InvalidArgument, ...), none a ClikaError
            if not is_torch:  # a tensor subclass defined outside torch went the numpy way: say so
                _refuse_tensors(self.input_names, self._devices(), feeds)
            raise GraphRunError(f"{self._where}: onnxruntime failed running the graph: {e}") from e

    def _feeds(self, args: tuple, kwargs: dict) -> list[Any]:
        if self._inputs is None:  # plain ONNX: by position, then by name
            given = dict(zip(self.input_names, args))
            given.update(kwargs)
            missing = [n for n in self.input_names if n not in given]
            unknown = [n for n in given if n not in self.input_names]
            if missing or unknown or len(args) > len(self.input_names):
                raise GraphInputError(
                    f"graph inputs are {self.input_names}; missing {missing}, unknown {unknown}, {len(args)} positional"
                )
            return [given[n] for n in self.input_names]
        args, kwargs = self._canonical(args, kwargs)
        args_desc, kwargs_desc = self._inputs["children"]
        args, kwargs = _empty_caches(args, kwargs, args_desc, kwargs_desc)
        if len(args) != len(args_desc["children"]):
            raise GraphInputError(
                f"expected {len(args_desc['children'])} positional inputs {self._parameters[:len(args_desc['children'])]}, "
                f"got {len(args)} (graph inputs: {self.input_names})"
            )
        walked = []
        try:
            for i, (desc, value) in enumerate(zip(args_desc["children"], args)):
                name = self._parameters[i] if i < len(self._parameters) else f"args_{i}"
                walked += treedesc.flatten_described(desc, value, name)
            walked += treedesc.flatten_described(kwargs_desc, kwargs, "")
        except ValueError as e:
            raise GraphInputError(f"{e} (graph inputs: {self.input_names})") from None
        feeds = []
        for path, value, leaf in walked:
            kind = leaf["kind"]
            if kind == "leaf":
                feeds.append(value)
            # type first: an array compared with a constant is an array, whose truth is ambiguous
            elif kind == "const" and not (type(value) is type(leaf["value"]) and value == leaf["value"]):
                raise GraphInputError(
                    f"input {path}: the graph was captured with the static value {leaf['value']!r}, got {value!r}"
                )
            elif kind == "static" and repr(value) != leaf["repr"]:
                raise GraphInputError(f"input {path}: the graph was captured with {leaf['repr']}, got {value!r}")
        return feeds

    def _canonical(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Keyword arguments that name positional parameters move to their slots, as at capture.

        A slot the call leaves out takes the value it was captured with, when that was a constant
        (a parameter default such as ``None``) or an empty cache (a prefill captured with one).
        """
        slots = self._inputs["children"][0]["children"]
        if not kwargs or len(args) >= len(slots):
            return args, kwargs
        positional = [self._parameters[i] if i < len(self._parameters) else None for i in range(len(slots))]
        planned = slotted(positional, len(args), tuple(kwargs), lambda i, _: _captured(slots[i]), to_the_end=True)
        if planned is None:
            return args, kwargs
        added, moved = planned
        return (args + tuple(kwargs[n] if v is KEYWORD else v for n, v in added),
                {k: v for k, v in kwargs.items() if k not in moved})

    def _run_torch(self, feeds: Sequence[Any]) -> list[Any]:
        """Run the torch runner. The usual tensor passes on its exact type and one attribute (on its
        place's device); anything else is looked at closely (``_looked_at``)."""
        import torch

        if self._torch is None:
            dtypes = [v.dtype for v in feeds] + [o.dtype for o in self._declared[1]]
            self._torch = serving.TorchRunner(self._session, self._place, self.input_names, self.output_names, dtypes)
            self._dlpack = self._torch.path == "dlpack"
        plain, on, names = torch.Tensor, self._on_place, self.input_names
        tensors = [v if type(v) is plain and getattr(v, on) else _looked_at(names, self._devices(), at, v)
                   for at, v in enumerate(feeds)]
        try:
            return self._torch.run(tensors)  # the runners resolve negative views themselves
        except Exception:  # a sparse tensor on the CPU passes the one-attribute look: refused here, by name
            _refuse_tensors(names, self._devices(), tensors)
            raise

    def _devices(self) -> tuple[str, ...]:
        """The devices a tensor fed to the torch runner may be on (DLPack moves a CUDA tensor to the CPU)."""
        return ("cpu", "cuda") if self._place.device == "cuda" or self._dlpack else ("cpu",)


def _looked_at(names: Sequence[str], devices: Sequence[str], at: int, value: Any) -> Any:
    """One feed looked at closely: an array as a tensor, and a tensor the runner would misread or
    fail on (another device, a sparse, nested or other layout, a subclass) refused with
    ``GraphInputError`` naming the input."""
    import torch

    if not isinstance(value, torch.Tensor):
        return torch.as_tensor(value)  # a numpy array among tensors
    got = _unusual_tensor(value, devices, torch)
    if got is not None:
        raise GraphInputError(f"input '{names[at]}': expected a dense strided torch.Tensor on "
                              f"{' or '.join(devices)}, got {got}")
    return value


def _refuse_tensors(names: Sequence[str], devices: Sequence[str], feeds: Sequence[Any]) -> None:
    """``GraphInputError`` for the first tensor ``_looked_at`` refuses among ``feeds``."""
    torch = sys.modules.get("torch")
    if torch is None:  # no tensor without torch: a torch-free box must not import it here
        return
    for at, value in enumerate(feeds):
        if isinstance(value, torch.Tensor):
            _looked_at(names, devices, at, value)


def _unusual_tensor(value: Any, devices: Sequence[str], torch: Any) -> str | None:
    """What ``value`` is, when it is not a dense strided tensor on one of ``devices``; else None."""
    if type(value) not in (torch.Tensor, torch.nn.Parameter):  # a subclass may hold no storage of its own
        return f"a {type(value).__name__} (a torch.Tensor subclass)"
    if value.is_nested:
        return "a nested tensor"
    if value.layout is not torch.strided:
        return f"a {value.layout} tensor"
    if value.device.type not in devices:
        return f"a tensor on {value.device}"
    return None


def _native(feeds: Sequence[Any]) -> list[Any]:
    """The feeds with arrays of the other byte order as native copies.

    Converted, not refused: their values are of the graph's dtype, only stored byte-swapped, and
    onnxruntime reads native bytes whatever the array says (a big-endian float32 read as ~1e37);
    the checked run already converts feeds where the graph needs it (lifted numbers to int64).
    The guard's walk, which every such array reaches (its dtype is not the native one the quick
    compare accepts), flags them: a native array never pays for the look or the copy.
    """
    return [v.astype(v.dtype.newbyteorder("=")) if not getattr(getattr(v, "dtype", None), "isnative", True) else v
            for v in feeds]


def _captured(slot: Mapping[str, Any]) -> Any:
    """What a skipped slot of a shipped call takes: the constant it was captured with, or the
    empty cache of a prefill; ``MISSING`` when neither."""
    if slot.get("kind") == "const":
        return slot["value"]
    empty = _empty_cache(slot)
    return MISSING if empty is None else empty


def _empty_cache(description: Mapping[str, Any]) -> tuple | None:
    """``((), (), ...)``, one empty tuple per layer, when ``description`` is a KV cache captured
    empty (a prefill captured from ``generate``, which passes the empty cache it made); else None."""
    children = description.get("children", ())
    if not description.get("cache") or not all(c.get("kind") == "tuple" and not c.get("children") for c in children):
        return None
    return tuple(() for _ in children)


def _empty_caches(args: tuple, kwargs: dict, args_desc: Mapping[str, Any],
                  kwargs_desc: Mapping[str, Any]) -> tuple[tuple, dict]:
    """``None`` (or nothing) where the graph was captured with an empty cache becomes that empty
    cache: what a caller writes first for a prefill (no cache, or ``cache=None``, the models' own
    default) is taken."""
    slots = args_desc["children"]
    args = tuple(_empty_cache(slots[i]) if v is None and i < len(slots) and _empty_cache(slots[i]) is not None else v
                 for i, v in enumerate(args))
    named = dict(zip(kwargs_desc.get("keys", ()), kwargs_desc.get("children", ())))
    kwargs = {k: _empty_cache(named[k]) if v is None and k in named and _empty_cache(named[k]) is not None else v
              for k, v in kwargs.items()}
    for key, description in named.items():  # left out altogether
        if key not in kwargs and _empty_cache(description) is not None:
            kwargs[key] = _empty_cache(description)
    return args, kwargs


class Declared(NamedTuple):
    """What an onnxruntime session says of its graph."""

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    metadata: dict[str, str]


def read_session(session: Any, where: str) -> Declared:
    """The session's declared inputs, outputs and metadata; ``GraphFileError`` when the file's
    names or metadata are not UTF-8 (onnxruntime's Python binding raises ``UnicodeDecodeError``
    on reading them, on every read: they are read once here)."""
    try:
        return Declared([tensor_info(i) for i in session.get_inputs()], [tensor_info(o) for o in session.get_outputs()],
                        serving.metadata(session))
    except UnicodeDecodeError as e:
        raise GraphFileError(f"{where}: a name or metadata value in the graph is not UTF-8 text ({e.reason})") from None


def metadata_and_guard(declared: Declared, where: str) -> tuple[metadata.Metadata | None, Guard]:
    """The graph's clika_runtime metadata, checked against the graph it ships with (``None`` for a
    graph from another tool), and the guard it is served with: the shipped one, or for a graph
    that ships none, one read from its declared inputs."""
    found = metadata.read(declared.metadata, where)
    if found is None:
        return None, _declared_guard(declared.inputs)
    metadata.check_fits(found, declared.inputs, declared.outputs, where)
    return found, found.guard if found.guard is not None else _declared_guard(declared.inputs)


def _check_output_types(found: metadata.Metadata | None, types: Mapping[str, type], where: str) -> None:
    """``GraphFileError`` when the output tree the graph describes needs a class not allowed here."""
    if found is not None:
        try:
            treedesc.check_types(found.outputs, types)
        except ValueError as e:
            raise GraphFileError(f"{where}: {e}") from None


def tensor_info(value: Any) -> TensorInfo:
    """An onnxruntime session input or output (``NodeArg``) as a ``TensorInfo``."""
    return TensorInfo(value.name, serving.DTYPE_NAMES.get(value.type, value.type), tuple(value.shape))


def _checked_file(path: str, verify_digest: bool) -> tuple[bytes | str, GraphFolder | None]:
    """What onnxruntime opens of a checked file: the bytes checked (and digested), read once, so
    that a file replaced meanwhile is not opened unchecked. A model that keeps data in other files
    is opened from a private copy of them (``_private_copy``), the folder returned with it."""
    checked = graphfile.check(path)
    source = Path(path).absolute().parent
    if not checked.contents.references:
        if verify_digest:
            digest.verify(checked.data, source, path)
        return checked.data, None
    try:
        folder = _private_copy(checked, source, path)
    except OSError as e:  # no writable temp folder, or no room: the files where they are, said
        say(f"clika_runtime: {path}: cannot copy the graph and its external data to the temp folder "
            f"({type(e).__name__}: {e.strerror or e}), so it is opened where it is: a data file rewritten in "
            "place while it serves reaches the served graph unchecked; set TMPDIR to a writable folder with "
            "room for its weights", 4)
        if verify_digest:
            digest.verify(checked.data, source, path)
        return path, None
    if verify_digest:
        digest.verify(checked.data, folder.path, path)  # the copies: what is checked is what runs
    return str(folder.model), folder


def _private_copy(checked: graphfile.Checked, source: Path, where: str) -> GraphFolder:
    """The model and its data files copied to a folder of this process's. onnxruntime maps external
    data files: one rewritten in place under a served graph (``cp`` over it) served other weights,
    unchecked, and one cut short killed the process (SIGBUS)."""
    folder = GraphFolder()
    for location in sorted({r.location for r in checked.contents.references}):
        target = folder.path / location
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # a data file that cannot be read is the graph's fault; one that cannot be written, the temp folder's
            data = open(source / location, "rb")
        except OSError as e:
            raise GraphFileError(f"{where}: external data location {location!r} names no file it can read "
                                 f"({type(e).__name__}: {e.strerror or e})") from e
        with data, open(target, "wb") as copy:
            shutil.copyfileobj(data, copy, 2**24)
    folder.model.write_bytes(checked.data)
    return folder


def _open(model: bytes | str, place: serving.Place, where: str) -> Any:
    try:
        return serving.open_session(model, place, intra_op_threads=config.session_threads())
    except serving.ProviderMissing as e:
        raise PlaceError(str(e)) from e
    except Exception as e:  # onnxruntime raises its own types for protobuf parse failures
        message = str(e)
        if isinstance(model, str) and ("external" in message.lower() or "No such file" in message):
            raise GraphFileError(f"{where}: external data missing or unreadable: {message}") from e
        raise GraphFileError(f"{where}: onnxruntime cannot load it (truncated or corrupt?): {message}") from e


def _declared_guard(inputs: Sequence[TensorInfo]) -> Guard:
    """The guard of a graph without ours (another tool's): its declared input dtypes and shapes."""
    rules = []
    for i in inputs:
        shape = tuple(d if isinstance(d, int) else (d or f"{i.name}_dim{a}") for a, d in enumerate(i.shape))
        rules.append(InputRule(i.name, i.dtype, shape))
    return Guard(tuple(rules))
