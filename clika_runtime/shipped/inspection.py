"""What a shipped graph holds, in a table: ``clika-runtime inspect``. It reads the file's
interface, opset, nodes and metadata (never its weights); nothing runs.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from clika_runtime.base.errors import GraphFileError
from clika_runtime.format import graphfile
from clika_runtime.format.interface import Port, interface
from clika_runtime.shipped.describe import describe_graph
from clika_runtime.triton.checker import latest_model
from clika_runtime.triton.rules import CONFIG_FILE, MODEL_FILE


def inspect_graph(path: str | os.PathLike) -> dict[str, Any]:
    """What a graph holds: inputs/outputs with dtypes and named dims, opset, nodes, size, metadata."""
    path = Path(path)
    if path.is_dir():
        raise GraphFileError(f"{path}: a folder, not a graph file: {what_to_pass(path, takes_model_folder=False)}")
    path, model = graphfile.read_checked(path)
    nodes = list(model.graph.node)
    data = [path.parent / location for location in _external_files(model)]
    try:
        description = describe_graph(model, str(path))
    except GraphFileError:
        raise
    except (KeyError, ValueError) as e:  # a hostile element type has no numpy dtype
        raise GraphFileError(f"{path}: the graph's inputs or outputs do not parse: {e}") from None
    declared = interface(model, initializers=True)  # as the file lists them, weights of old graphs too
    return {
        "capture": {"key": description.key, "guard": description.guard, "precision": description.precision},
        "path": str(path),
        "graph_name": model.graph.name,
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": _in_words(declared.inputs),
        "outputs": _in_words(declared.outputs),
        "nodes": len(nodes),
        "ops": dict(Counter(n.op_type for n in nodes).most_common()),
        "size_bytes": path.stat().st_size + sum(p.stat().st_size for p in set(data) if p.is_file()),
        "external_data": sorted({str(p.name) for p in data}),
        "metadata": {p.key: p.value for p in model.metadata_props},
    }


def _in_words(ports: Sequence[Port]) -> list[dict[str, Any]]:
    """Inputs or outputs with ONNX's type names (``float``, ``int64``) and dims, ``?`` where unnamed."""
    import onnx

    described = []
    for port in ports:
        known = port.elem_type in onnx.TensorProto.DataType.values()
        dtype = onnx.TensorProto.DataType.Name(port.elem_type) if known else f"unknown type {port.elem_type}"
        dims = [d if d != "" else "?" for d in port.dims or ()]
        described.append({"name": port.name, "dtype": dtype.lower(), "dims": dims})
    return described


def _external_files(model: Any) -> list[str]:
    return [e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"]


def format_inspection(info: Mapping[str, Any]) -> str:
    """A readable table of ``inspect_graph``'s result."""
    lines = [f"graph {info['graph_name']!r}  ({info['path']}, {info['size_bytes']:,} bytes)"]
    if info["capture"]["key"]:
        lines.append(f"captured for: {info['capture']['key']}")
    if info["capture"]["guard"]:
        lines.append(f"guard: {info['capture']['guard']}")
    if info["capture"].get("precision"):
        lines.append(f"precision: {info['capture']['precision']}")
    lines.append("opset: " + ", ".join(f"{d} {v}" for d, v in info["opset"].items()))
    for kind in ("inputs", "outputs"):
        lines.append(f"{kind}:")
        for v in info[kind]:
            lines.append(f"  {v['name']:<28} {v['dtype']:<9} [{', '.join(map(str, v['dims']))}]")
    lines.append(f"nodes: {info['nodes']}  ops: " + ", ".join(f"{op}×{n}" for op, n in info["ops"].items()))
    if info["external_data"]:
        lines.append("external data: " + ", ".join(info["external_data"]))
    for key, value in info["metadata"].items():
        lines.append(f"meta {key}: {value if len(value) < 100 else value[:97] + '...'}")
    return "\n".join(lines)


def what_to_pass(folder: Path, *, takes_model_folder: bool) -> str:
    """What to give instead of ``folder``: the graph it holds, or, for Triton's layouts, a model's
    file (``inspect``) or a model folder (``validate``)."""
    if (folder / CONFIG_FILE).is_file():  # only inspect refuses a model folder
        model = latest_model(folder)[1]
        return (f"it is a Triton model folder: pass its model file, {model or folder / '<version>' / MODEL_FILE} "
                f"(validate takes the folder itself)")
    models = sorted(p.parent for p in folder.glob(f"*/{CONFIG_FILE}"))
    if models:
        if takes_model_folder:
            return f"it is a Triton model repository: validate one model folder, e.g. {models[0]}"
        model = latest_model(models[0])[1]
        return f"it is a Triton model repository: pass a model's file, e.g. {model or models[0]}"
    graphs = sorted(folder.glob("*.onnx"))
    if len(graphs) == 1:
        return f"it holds one graph, pass {graphs[0]}"
    if graphs:
        return f"it holds {len(graphs)} graphs, pass one: {', '.join(p.name for p in graphs[:5])}"
    return "give an .onnx file or a Triton model folder" if takes_model_folder else "give an .onnx file"
