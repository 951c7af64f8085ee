"""A shipped fp32 graph quantized to int8 (``ModelGraph.quantized``), judged against itself.

The fp32 graph and its int8 copy run on the same inputs: the caller's, else generated ones at the
sizes of the capture's example (random floats, small non-negative integers:
``validation.generated_feeds``), and the int8 copy is kept only when it agrees by the ``Agreement``
asked for, each output whole and then by rows, as a capture is judged. No torch: a graph captured
elsewhere can be quantized on a box with onnxruntime and numpy only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

import serving
from clika_runtime.base.errors import VerificationError
from clika_runtime.base.owners import OWNED, owned
from clika_runtime.base.precision import INT8, Agreement, Record, judged, rows_problem
from clika_runtime.format import metadata
from clika_runtime.format.graphfile import too_big
from clika_runtime.shipped.served import metadata_and_guard, read_session
from clika_runtime.shipped.validation import generated_feeds
from serving import quantize


def quantized(model_proto: Any, agreement: Agreement, where: str, inputs: Mapping[str, Any] | None = None,
              seed: int = 0) -> Any:
    """``model_proto`` quantized to int8, judged on ``inputs`` (generated where ``None``), carrying
    its measured agreement in its metadata; ``VerificationError`` when it falls short of
    ``agreement``, ``ValueError`` when the graph has nothing to quantize or ``inputs`` do not
    name its inputs."""
    import onnx

    with tempfile.TemporaryDirectory(prefix=owned(OWNED)) as folder:  # a killed process's: removed later
        source, target = Path(folder) / "model.onnx", Path(folder) / "int8.onnx"
        onnx.save_model(model_proto, str(source), save_as_external_data=too_big(model_proto),
                        location="model.onnx.data")
        if not quantize.quantize_int8(str(source), str(target)):
            raise ValueError(f"{where}: the graph has no MatMul over a constant float32 weight to quantize")
        cpu = serving.resolve("cpu")
        reference, reduced = (serving.open_session(str(path), cpu) for path in (source, target))
        feeds = _given(reference, inputs) if inputs is not None else _generated(reference, where, seed)
        names = [o.name for o in reference.get_outputs()]
        wanted, got = reference.run(None, feeds), reduced.run(None, feeds)
        measured, short = judged(agreement, names, wanted, got)
        rows = (rows_problem(agreement, n, w, g) for n, w, g in zip(names, wanted, got))
        short = short or next((p for p in rows if p), None)
        if short:
            raise VerificationError(f"{where}: the int8 graph's agreement with the fp32 graph falls short: {short}")
        proto = onnx.load(str(target))
    metadata.attach(proto, {metadata.META_PRECISION: Record(INT8, agreement, tuple(measured)).to_json()})
    return proto


def _given(session: Any, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The caller's batch as the graph takes it: every input named, none empty, each in the
    graph's dtype (ids of int32 for an int64 graph are cast; a float for an int is refused)."""
    ports = {i.name: _numpy_dtype(i.type) for i in session.get_inputs()}
    missing, other = [n for n in ports if n not in inputs], sorted(n for n in inputs if n not in ports)
    if missing or other:
        said = [f"lack {missing}"] * bool(missing) + [f"name {other}, which the graph does not take"] * bool(other)
        raise ValueError(f"quantized: inputs {' and '.join(said)}: it takes {list(ports)}")
    feeds = {}
    for name, dtype in ports.items():
        value = np.asarray(inputs[name])
        if value.size == 0:
            raise ValueError(f"quantized: input '{name}' is empty {value.shape}: give a batch of data to judge the "
                             f"int8 graph on")
        if dtype is not None and value.dtype != dtype:
            if np.issubdtype(value.dtype, np.integer) != np.issubdtype(dtype, np.integer):
                raise ValueError(f"quantized: input '{name}' is {value.dtype}, the graph takes {dtype}")
            value = value.astype(dtype)
        feeds[name] = value
    return feeds


def _numpy_dtype(ort_type: str) -> np.dtype | None:
    """The numpy dtype of an onnxruntime type string (``None`` where numpy has none: bfloat16)."""
    name = serving.DTYPE_NAMES.get(ort_type)
    return np.dtype(name) if name is not None and name != "bfloat16" else None


def _generated(session: Any, where: str, seed: int) -> dict[str, np.ndarray]:
    guard = metadata_and_guard(read_session(session, where), where)[1]
    sizes = {dim: size for dim, size in guard.example if not dim.startswith("#")}
    feeds = generated_feeds(session, guard, sizes, np.random.default_rng(seed))
    missing = [name for name, value in feeds.items() if value is None]
    if missing:
        raise ValueError(f"{where}: input(s) {missing} cannot be generated (bfloat16, complex or too large) to "
                         f"check the int8 graph against: give quantized(inputs=...)")
    return feeds
