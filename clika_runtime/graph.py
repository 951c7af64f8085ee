"""``ModelGraph``: a captured graph to ship, and ``load`` to serve a shipped one.

Nothing here imports torch at module level, and ``load`` needs neither torch nor onnx: a deployment
box with onnxruntime and numpy serves a shipped graph with the same pytree in and out.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

import serving
from clika_runtime import treedesc
from clika_runtime.config import config
from clika_runtime.errors import GraphFileError, GraphInputError, PlaceError
from clika_runtime.specs import PlaceLike

VERSION = "0.1.0"
META_VERSION = "clika_runtime.version"
META_INPUTS = "clika_runtime.inputs"
META_OUTPUTS = "clika_runtime.outputs"
META_DIMS = "clika_runtime.dims"
META_PARAMETERS = "clika_runtime.parameters"

# Protobuf cannot serialise a message past 2 GiB: past this many bytes of weights (a margin left
# for the rest of the model) they go to an external file, for saving and for opening sessions.
_PROTOBUF_LIMIT = 2**31 - 2**26

ONNX_TYPE_NAMES = serving.DTYPE_NAMES  # onnxruntime's type strings -> dtype names (numpy's, and bfloat16)


class TensorInfo(NamedTuple):
    """A graph input or output as the graph declares it."""

    name: str
    dtype: str  # numpy's name ("float32", "int64", "bool"), or "bfloat16"
    shape: tuple[int | str | None, ...]  # an int per static axis; the dim's name (or None) per dynamic axis


class ModelGraph:
    """A captured graph: the ONNX model plus what is needed to serve it with the same pytrees.

    Made by ``CompiledFunction.take_graph()`` or ``ModelGraph.load(path)``. ``save`` writes a
    standard ``.onnx`` file that any onnxruntime (any language) loads; the pytree structure, dim
    names and library version travel in the model's ``metadata_props``.
    """

    def __init__(self, model_proto: Any) -> None:
        self._proto = model_proto
        meta = {p.key: p.value for p in model_proto.metadata_props}
        self._inputs = json.loads(meta[META_INPUTS]) if META_INPUTS in meta else None
        self._outputs = json.loads(meta[META_OUTPUTS]) if META_OUTPUTS in meta else None

    @property
    def model_proto(self) -> Any:
        """The ``onnx.ModelProto``."""
        return self._proto

    @property
    def input_names(self) -> list[str]:
        """Graph input names, in flattening order of the input pytree."""
        initializers = {i.name for i in self._proto.graph.initializer}
        return [i.name for i in self._proto.graph.input if i.name not in initializers]

    @property
    def output_names(self) -> list[str]:
        """Graph output names, in flattening order of the output pytree."""
        return [o.name for o in self._proto.graph.output]

    @property
    def graph_name(self) -> str:
        """The ONNX graph's name."""
        return self._proto.graph.name

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """``{input_or_output_name: {axis: dim_name}}`` for every dynamic axis, torch.onnx.export's form."""
        axes: dict[str, dict[int, str]] = {}
        for value in list(self._proto.graph.input) + list(self._proto.graph.output):
            dims = value.type.tensor_type.shape.dim
            named = {a: d.dim_param for a, d in enumerate(dims) if d.dim_param}
            if named:
                axes[value.name] = named
        return axes

    def save(self, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
        """Write the graph to ``path`` (a ``.onnx`` file).

        ``external_data``: ``None`` puts weights in ``<name>.data`` beside the file only when the
        model is past protobuf's 2 GB limit; ``True`` always; ``False`` never.
        """
        import onnx

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if external_data is None:
            external_data = too_big(self._proto)
        if external_data:
            onnx.save_model(
                self._proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                location=f"{path.name}.data", size_threshold=0,
            )
            # save_model moved the weights out of the in-memory proto: bring them back.
            onnx.load_external_data_for_model(self._proto, str(path.parent))
        else:
            onnx.save_model(self._proto, str(path))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelGraph":
        """Read a ``.onnx`` file (with its external data, if any)."""
        import onnx

        path = _existing(path)
        try:
            proto = onnx.load_model(str(path))
        except FileNotFoundError as e:
            raise GraphFileError(f"{path}: external data file missing: {e.filename or e}") from e
        except Exception as e:
            raise GraphFileError(f"{path}: not a readable ONNX model (truncated or corrupt?): {e}") from e
        return cls(proto)

    def serve(self, place: PlaceLike = None) -> "ServedGraph":
        """A callable serving this graph on ``place`` with the captured pytrees in and out."""
        source, folder = session_source(self._proto)
        return ServedGraph(source, place, keep=folder)

    def __repr__(self) -> str:
        return f"ModelGraph({self.graph_name!r}, inputs={self.input_names}, outputs={self.output_names})"


def load(path: str | os.PathLike, place: PlaceLike = None) -> "ServedGraph":
    """Serve a shipped ``.onnx`` file: ``ModelGraph.load(path).serve(place)``, without needing onnx.

    Graphs saved by clika_runtime take and return the captured pytrees; any other ONNX graph takes
    its inputs by name (or position) and returns ``{output name: value}``. numpy arrays in give
    numpy arrays out; torch tensors in give torch tensors out.
    """
    return ServedGraph(str(_existing(path)), place)


def too_big(model_proto: Any) -> bool:
    """Whether the model's weights are past what protobuf can serialise in one message."""
    return sum(len(t.raw_data) for t in model_proto.graph.initializer) > _PROTOBUF_LIMIT


def session_source(model_proto: Any) -> tuple[bytes | str, tempfile.TemporaryDirectory | None]:
    """What onnxruntime opens: the serialised model, or, past protobuf's limit, a temporary file
    with external data (the returned folder must outlive the session)."""
    if not too_big(model_proto):
        return model_proto.SerializeToString(), None
    folder = tempfile.TemporaryDirectory(prefix="clika_runtime_")
    path = ModelGraph(model_proto).save(Path(folder.name) / "graph.onnx", external_data=True)
    return str(path), folder


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise GraphFileError(f"{path}: no such file")
    return path


def _resolve_place(place: PlaceLike) -> serving.Place:
    try:
        return serving.resolve(place)
    except ValueError as e:
        raise PlaceError(str(e)) from e


class ServedGraph:
    """A shipped graph served by onnxruntime, called like the function it was captured from."""

    def __init__(self, model: bytes | str, place: PlaceLike = None, *, keep: Any = None) -> None:
        self._keep = keep  # a temporary folder holding the model's external data, if any
        self._place = _resolve_place(place)
        where = model if isinstance(model, str) else "graph"
        try:
            self._session = serving.open_session(model, self._place, intra_op_threads=_threads())
        except RuntimeError as e:
            message = str(e)
            if "did not start" in message:
                raise PlaceError(message) from e
            if isinstance(model, str) and ("external" in message.lower() or "No such file" in message):
                raise GraphFileError(f"{where}: external data missing or unreadable: {message}") from e
            raise GraphFileError(f"{where}: onnxruntime cannot load it (truncated or corrupt?): {message}") from e
        except Exception as e:  # onnxruntime raises its own types for protobuf parse failures
            raise GraphFileError(f"{where}: onnxruntime cannot load it (truncated or corrupt?): {e}") from e
        meta = serving.metadata(self._session)
        self._inputs = json.loads(meta[META_INPUTS]) if META_INPUTS in meta else None
        self._outputs = json.loads(meta[META_OUTPUTS]) if META_OUTPUTS in meta else None
        self._parameters = json.loads(meta.get(META_PARAMETERS, "[]"))
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self._expect = [_info(i) for i in self._session.get_inputs()]
        self._declared_outputs = [_info(o) for o in self._session.get_outputs()]
        self._numpy = serving.NumpyRunner(self._session, self.input_names, self.output_names)
        self._numpy_unfit = [o.name for o in self._session.get_outputs() if o.type == "tensor(bfloat16)"]
        self._torch: Any = None

    @property
    def providers(self) -> list[str]:
        """The onnxruntime providers the session really runs on."""
        return self._session.get_providers()

    @property
    def inputs(self) -> list[TensorInfo]:
        """The graph's inputs as declared (name, dtype, shape), in input order."""
        return list(self._expect)

    @property
    def outputs(self) -> list[TensorInfo]:
        """The graph's outputs as declared (name, dtype, shape), in output order."""
        return list(self._declared_outputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs = self._checked_run(self._feeds(args, kwargs))
        if self._outputs is None:
            return dict(zip(self.output_names, outs))
        return treedesc.rebuild(self._outputs, iter(outs))

    def run(self, feeds: Mapping[str, Any], /) -> dict[str, Any]:
        """Run on arrays given by graph input name; returns ``{output name: array}``.

        The flat form of a call, for servers that speak graph input names (the KServe v2 server):
        the checks of a call, without the captured pytrees.
        """
        missing = [n for n in self.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self.input_names]
        if missing or unknown:
            raise GraphInputError(f"graph inputs are {self.input_names}; missing {missing}, unknown {unknown}")
        return dict(zip(self.output_names, self._checked_run([feeds[n] for n in self.input_names])))

    def _checked_run(self, feeds: list[Any]) -> list[Any]:
        """Check each input against the graph's declaration, then run; outputs in output order."""
        for i, ((name, dtype, shape), value) in enumerate(zip(self._expect, feeds)):
            if type(value) in (int, float) and not shape:  # a lifted Python number
                feeds[i] = value = np.asarray(value, dtype=dtype)
            _check_input(name, dtype, shape, value)
        is_torch = any(type(v).__module__.startswith("torch") for v in feeds)
        if not is_torch and self._numpy_unfit:
            raise GraphInputError(
                f"output(s) {self._numpy_unfit} are bfloat16, which numpy cannot hold: call with torch tensors"
            )
        return self._run_torch(feeds) if is_torch else self._numpy.run(feeds)

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
            elif kind == "const" and not (value == leaf["value"] and type(value) is type(leaf["value"])):
                raise GraphInputError(
                    f"input {path}: the graph was captured with the static value {leaf['value']!r}, got {value!r}"
                )
            elif kind == "static" and repr(value) != leaf["repr"]:
                raise GraphInputError(f"input {path}: the graph was captured with {leaf['repr']}, got {value!r}")
        return feeds

    def _canonical(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Keyword arguments that name positional parameters move to their slots, as at capture.

        A slot the call leaves out takes the value it was captured with, when that was a constant
        (a parameter default such as ``None``).
        """
        slots = self._inputs["children"][0]["children"]
        if not kwargs or len(args) >= len(slots):
            return args, kwargs
        moved, filled = [], []
        for i in range(len(args), len(slots)):
            name = self._parameters[i] if i < len(self._parameters) else None
            if name in kwargs:
                moved.append(name)
                filled.append(kwargs[name])
            elif slots[i].get("kind") == "const":
                filled.append(slots[i]["value"])
            else:
                break
        if not moved:
            return args, kwargs
        return args + tuple(filled), {k: v for k, v in kwargs.items() if k not in moved}

    def _run_torch(self, feeds: Sequence[Any]) -> list[Any]:
        import torch

        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in feeds]
        if self._torch is None:
            dtypes = [t.dtype for t in tensors] + [ONNX_TYPE_NAMES.get(o.type, o.type) for o in self._session.get_outputs()]
            self._torch = serving.TorchRunner(self._session, self._place, self.input_names, self.output_names, dtypes)
        return self._torch.run(tensors)


def _info(value: Any) -> TensorInfo:
    return TensorInfo(value.name, ONNX_TYPE_NAMES.get(value.type, value.type), tuple(value.shape))


def _check_input(name: str, dtype: str, shape: Sequence[Any], value: Any) -> None:
    got_dtype = str(getattr(value, "dtype", type(value).__name__)).replace("torch.", "")
    got_shape = tuple(getattr(value, "shape", ()))
    if not hasattr(value, "shape"):
        raise GraphInputError(f"input '{name}': expected an array of {dtype}, got {type(value).__name__}")
    if got_dtype != dtype:
        raise GraphInputError(f"input '{name}': expected dtype {dtype}, got {got_dtype}")
    if len(got_shape) != len(shape):
        raise GraphInputError(f"input '{name}': expected rank {len(shape)} {_dims(shape)}, got shape {got_shape}")
    for axis, (want, got) in enumerate(zip(shape, got_shape)):
        if isinstance(want, int) and want != got:
            raise GraphInputError(f"input '{name}' axis {axis}: expected size {want} {_dims(shape)}, got {got}")


def _dims(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _threads() -> int | None:
    torch = sys.modules.get("torch")
    return config.intra_op_threads or (torch.get_num_threads() if torch is not None else None)


def attach_metadata(model_proto: Any, entries: Mapping[str, Any]) -> None:
    """Set ``metadata_props`` entries (JSON-encoded unless already strings)."""
    existing = {p.key: p for p in model_proto.metadata_props}
    for key, value in entries.items():
        text = value if isinstance(value, str) else json.dumps(value)
        if key in existing:
            existing[key].value = text
        else:
            prop = model_proto.metadata_props.add()
            prop.key, prop.value = key, text
