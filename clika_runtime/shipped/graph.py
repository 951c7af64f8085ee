"""``ModelGraph``: a captured graph as a shippable artefact (the ONNX model and its metadata).

Serving a graph lives in served.py; the metadata schema in metadata.py. Nothing here imports
torch; onnx is imported where a method needs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

from clika_runtime.base.precision import Agreement
from clika_runtime.base.specs import PlaceLike
from clika_runtime.format import digest, graphfile, metadata, writing
from clika_runtime.format.graphfile import existing, too_big
from clika_runtime.format.interface import interface
from clika_runtime.shipped.folder import GraphFolder


class ModelGraph:
    """A captured graph: the ONNX model plus what is needed to serve it with the same pytrees.

    Made by ``CompiledFunction.take_graph()`` / ``graphs()`` or ``ModelGraph.load(path)``. ``save``
    writes a standard ``.onnx`` file that any onnxruntime (any language) loads; the pytree
    structure, dim names, shape guard and library version travel in the model's ``metadata_props``.
    """

    def __init__(self, model_proto: Any) -> None:
        self._proto = model_proto

    @classmethod
    def copy_of(cls, model_proto: Any) -> "ModelGraph":
        """A graph holding its own copy of ``model_proto`` (changing it changes nothing else)."""
        import onnx

        copy = onnx.ModelProto()
        copy.CopyFrom(model_proto)
        return cls(copy)

    @property
    def model_proto(self) -> Any:
        """The ``onnx.ModelProto``."""
        return self._proto

    @property
    def input_names(self) -> list[str]:
        """Graph input names, in flattening order of the input pytree."""
        return [i.name for i in interface(self._proto).inputs]

    @property
    def output_names(self) -> list[str]:
        """Graph output names, in flattening order of the output pytree."""
        return [o.name for o in interface(self._proto).outputs]

    @property
    def graph_name(self) -> str:
        """The ONNX graph's name."""
        return self._proto.graph.name

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """``{input_or_output_name: {axis: dim_name}}`` for every dynamic axis, torch.onnx.export's form."""
        axes: dict[str, dict[int, str]] = {}
        declared = interface(self._proto, initializers=True)
        for port in declared.inputs + declared.outputs:
            named = {a: d for a, d in enumerate(port.dims or ()) if isinstance(d, str) and d}
            if named:
                axes[port.name] = named
        return axes

    @property
    def metadata(self) -> dict[str, str]:
        """The model's ``metadata_props``."""
        return {p.key: p.value for p in self._proto.metadata_props}

    def save(self, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
        """Write the graph to ``path`` (a ``.onnx`` file), with its content digest in the metadata.

        ``external_data``: ``None`` puts weights in a data file beside the file only when the
        model is past protobuf's 2 GB limit; ``True`` always; ``False`` never. The data file is
        named after the content (``<name>.<digest>.data``). The write is atomic: each file is
        written under a temporary name in the same folder and renamed into place, the data file
        before the model, so a reader sees the old graph or the new one, whole. The graph in
        memory is not changed.
        """
        if os.fspath(path).endswith(("/", os.sep)):  # Path() drops the slash: a file of the folder's name
            raise IsADirectoryError(f"save: {os.fspath(path)!r} names a folder: give a file path, "
                                    f"e.g. {Path(path) / 'model.onnx'}")
        if external_data is None:
            external_data = too_big(self._proto)
        return writing.save(self._proto, Path(path), external_data=external_data)

    def quantized(self, precision: str = "int8", *, agreement: Agreement | None = None,
                  inputs: Mapping[str, Any] | None = None) -> "ModelGraph":
        """This graph at reduced precision, as a new graph: ``"int8"`` is onnxruntime's dynamic
        int8 (CPU), with standard ONNX ops only (``MatMulInteger``, ``DynamicQuantizeLinear``).

        Both graphs run on ``inputs`` (arrays by graph input name: give a real batch, as wide as
        those it will serve; else generated inputs at the capture's example sizes, which say
        little of a model of real data: token ids of 0 and 1, random floats) and the int8 graph is
        returned only when it agrees with this one by ``agreement`` (default
        ``config.agreement``; each output whole, then its rows, as a capture is judged), else
        ``VerificationError`` with the figures; the measured agreement
        is in its metadata (``inspect`` shows it, ``validate`` compares by it). ``ValueError``
        for another precision (fp16 is made by capturing with ``precision="fp16"`` on CUDA,
        where it can be verified) or a graph already reduced.
        """
        from clika_runtime.base.config import config
        from clika_runtime.shipped.quantizing import quantized

        if precision != "int8":
            raise ValueError(f"quantized: expected 'int8', got {precision!r} (an fp16 graph is captured on CUDA with "
                             f"cr.compile(..., precision='fp16'), where it is checked)")
        if metadata.META_PRECISION in self.metadata:
            raise ValueError("quantized: this graph is already at reduced precision; quantize the fp32 graph")
        return ModelGraph(quantized(self._proto, agreement or config.agreement, repr(self), inputs))

    def to_triton(
        self,
        repository: str | os.PathLike,
        name: str | None = None,
        *,
        version: int = 1,
        max_batch_size: int = 0,
        dynamic_batching: bool | Mapping[str, Any] | None = None,
        instances: int = 1,
        kind: Literal["cpu", "gpu"] = "cpu",
        external_data: bool | None = None,
    ) -> Path:
        """Write the graph as a Triton model: ``<repository>/<name>/config.pbtxt`` and
        ``<repository>/<name>/<version>/model.onnx``; return the model folder ``<repository>/<name>``.

        ``name``: default from the graph name. ``max_batch_size > 0`` lets Triton batch requests
        along dim 0, which needs dim 0 of every input and output to be one dynamic dim (the batch);
        ``dynamic_batching``: ``True`` (Triton's defaults) or ``{"preferred_batch_size": [...],
        "max_queue_delay_microseconds": N}``. ``instances`` model instances of ``kind`` ("cpu" or
        "gpu"). ``external_data`` as in ``save``; with external data the version holds a folder
        ``model.onnx/`` with ``model.onnx`` and its data, the layout Triton documents. Raises
        ``DeployError`` (before writing anything) for what Triton would refuse: see docs/DEPLOY.md.
        """
        from clika_runtime.triton.writer import write_model

        return write_model(
            self, repository, name, version=version, max_batch_size=max_batch_size,
            dynamic_batching=dynamic_batching, instances=instances, kind=kind, external_data=external_data,
        )

    @classmethod
    def load(cls, path: str | os.PathLike, *, verify_digest: bool = True) -> "ModelGraph":
        """Read a ``.onnx`` file (with its external data, if any, which must be regular files in its
        folder); ``GraphFileError`` for a file that reaches outside it, whose metadata is malformed,
        or whose content is not what its digest records (``verify_digest=False`` skips that check;
        a file without a digest loads, with an INFO log line). The graph in memory holds no
        digest: ``save`` records one for the file it writes."""
        path = existing(path)
        checked = graphfile.check(path)
        regions: dict[tuple[str, bytes | None, bytes | None], bytes] = {}
        if verify_digest:
            digest.verify(checked.data, path.absolute().parent, str(path), keep=regions)
        proto = graphfile.parsed(checked.data, path)
        _place_external_data(proto, path, regions)
        metadata.read({p.key: p.value for p in proto.metadata_props}, str(path))  # refuse a malformed graph now
        # The digest is the file's, not the model's: kept, it would go stale with any change made
        # to the graph in memory (quantized(), an edit then onnx.save). save() writes a new one.
        kept = [p for p in proto.metadata_props if p.key != metadata.META_DIGEST]
        del proto.metadata_props[:]
        proto.metadata_props.extend(kept)
        return cls(proto)

    def serve(self, place: PlaceLike = None, *, output_types: Any = ()) -> Any:
        """A callable serving this graph on ``place`` with the captured pytrees in and out
        (``output_types``: classes output trees may be rebuilt with, see ``cr.load``)."""
        from clika_runtime.shipped.served import ServedGraph

        source, folder = session_source(self._proto)
        # A temporary file of our own when the graph is past protobuf's limit: it has no digest to check.
        return ServedGraph(source, place, output_types=output_types, keep=folder, verify_digest=False)

    def __repr__(self) -> str:
        return f"ModelGraph({self.graph_name!r}, inputs={self.input_names}, outputs={self.output_names})"


def session_source(model_proto: Any) -> tuple[bytes | str, GraphFolder | None]:
    """What onnxruntime opens: the serialised model, or, past protobuf's limit, a temporary file
    with external data (the returned folder must outlive the session)."""
    if not too_big(model_proto):
        return model_proto.SerializeToString(), None
    folder = GraphFolder.write(model_proto)
    return str(folder.model), folder


def _place_external_data(proto: Any, path: Path, regions: dict[tuple[str, bytes | None, bytes | None], bytes]
                         ) -> None:
    """Put each external tensor's bytes in ``proto``: those the digest check read (``regions``),
    else read now. Read here rather than by onnx, which refuses a data file with several hard
    links: the disk cache links its entries' files, so a capture's graph has such a data file."""
    from onnx import TensorProto
    from onnx.external_data_helper import _get_all_tensors  # the tensors onnx itself loads data for

    folder = path.absolute().parent
    for tensor in _get_all_tensors(proto):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        offset, length = (info[k].encode() if k in info else None for k in ("offset", "length"))
        data = regions.pop((location, offset, length), None)  # let go of each as it is placed: one copy at a time
        if data is None:
            data = digest.region(folder, location, offset, length, tensor.name, str(path))
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
