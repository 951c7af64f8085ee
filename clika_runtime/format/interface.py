"""What a graph declares of its inputs and outputs, read from its ``ModelProto``: each one's name,
ONNX element type and dims.

The one reader of a graph's interface in a model: the Triton writer and checker, ``inspect``,
a saved graph's description and ``ModelGraph``'s names each put its ``Port``s in their own words
(Triton's data types, ONNX's type names, numpy's dtype names). A served graph reads the same from
its onnxruntime session instead (``shipped.served.read_session``): a box that serves has no onnx.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Port(NamedTuple):
    """One graph input or output as the graph declares it. ``dims`` is ``None`` when the graph
    gives no shape; each dim is an int (static) or the dim's name (dynamic, ``""`` when unnamed)."""

    name: str
    elem_type: int  # onnx.TensorProto's code; 0 for a value that is not a tensor
    dims: tuple[int | str, ...] | None


class Interface(NamedTuple):
    """A graph's inputs and outputs, in the graph's order."""

    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]


def interface(model_proto: Any, *, initializers: bool = False) -> Interface:
    """The graph's inputs and outputs. An input that names an initializer (graphs of IR version
    < 4 list their weights as inputs) is left out, as onnxruntime leaves it, unless ``initializers``."""
    inputs = model_proto.graph.input
    if not initializers:
        weights = {i.name for i in model_proto.graph.initializer}
        inputs = [v for v in inputs if v.name not in weights]
    return Interface(tuple(_port(v) for v in inputs), tuple(_port(v) for v in model_proto.graph.output))


def _port(value: Any) -> Port:
    tensor_type = value.type.tensor_type
    dims = None
    if tensor_type.HasField("shape"):
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim)
    return Port(value.name, tensor_type.elem_type, dims)
