"""torch callable + example tensors + names and dynamic axes -> ``onnx.ModelProto``.

Plain data in, plain data out: this package knows nothing of clika_runtime or serving.
"""

from exporters.dynamo import (
    DrawsRandom, ExportedGraph, Uncapturable, WritesState, export_graph, model_bytes, outputs, save,
)
from exporters.fusion import save_fused
from exporters.raising import DECLINES

__all__ = [
    "DECLINES", "DrawsRandom", "ExportedGraph", "Uncapturable", "WritesState", "export_graph", "model_bytes", "outputs",
    "save",
    "save_fused",
]
