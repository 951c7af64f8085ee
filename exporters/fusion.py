"""onnxruntime's fused transformer kernels for an exported graph, written beside the portable one.

The dynamo exporter writes attention as its parts (MatMul, Softmax, masks) and layer norms and
GELUs as separate ops, and onnxruntime's own optimiser does not recognise them in that form. The
onnxscript rewriter does: it turns them into onnxruntime's contrib ops (``Attention``,
``MultiHeadAttention``, ``SkipLayerNormalization``, ``BiasGelu``...), which run attention without
materialising the masked score tensor. BERT-base at (batch 1, sequence 512) runs in ~0.83x the
time of the unfused graph on this project's machine.

Those ops exist in onnxruntime only, so the fused graph is for serving: the portable graph stays
what is handed out. The fused file shares the portable file's weight data (tensors the rewriter
leaves alone are references into it); only tensors it made (packed QKV weights) are written anew.
"""

from __future__ import annotations

import os
import onnx_ir as ir
from onnx_ir import external_data

from exporters.quiet import quiet

# Ops whose presence means a fusion can apply: attention (Softmax), layer/RMS norms, GELU forms,
# rotary embeddings. A graph without any is left alone (the rewriter costs time on every graph).
_CANDIDATES = frozenset({"Softmax", "LayerNormalization", "Erf", "Tanh", "ReduceMean", "Sin", "Cos"})
_EXTERNAL_MIN_BYTES = 1024


def worth_fusing(model: ir.Model) -> bool:
    """Whether the graph holds an op a transformer fusion starts from."""
    return any(node.op_type in _CANDIDATES for node in model.graph.all_nodes())


def externalize(model: ir.Model, path: str) -> None:
    """Write ``model`` to ``path`` with its weights (over 1 KiB) in ``<path>.data``, and make its
    initializers references into that file, so a graph derived from it can point at the same data."""
    folder, name = os.path.split(path)
    external_data.unload_from_model(model, folder, f"{name}.data", size_threshold_bytes=_EXTERNAL_MIN_BYTES)
    ir.save(model, path)


def save_fused(model: ir.Model, path: str, for_cpu: bool = True) -> dict[str, int]:
    """Rewrite ``model`` in place with onnxruntime's fused kernels and write it to ``path``; how
    many of each fusion were made. Nothing is written when no fusion applies (``{}``).
    ``for_cpu``: the graph serves on onnxruntime's CPU provider, whose ``SkipLayerNormalization``
    is slower than the two ops it fuses, so residual adds are kept out of it (they count as
    ``skip_kept_apart``).

    Call it after the portable graph is saved: the model is not portable afterwards. The tensors
    the rewriter made go to ``<path>.data``; the others stay references to the file they live in.
    """
    if not worth_fusing(model):
        return {}
    from onnxscript.rewriter.ort_fusions import optimize_for_ort  # imported on use: a second or so

    apart = residual_adds_as_sums(model) if for_cpu else 0
    with quiet():  # the rewriter logs each constant it could not fold
        _, counts = optimize_for_ort(model)
    made = {name: count for name, count in counts.items() if count}
    if made and apart:
        made["skip_kept_apart"] = apart
    if made:
        _save(model, path)
    return made


def residual_adds_as_sums(model: ir.Model) -> int:
    """Write each ``Add`` of two computed values read only as a ``LayerNormalization``'s input as
    ``Sum`` (the same values), which neither the rewriter nor onnxruntime fuses into
    ``SkipLayerNormalization``: its CPU kernel is scalar code, 2.2-3.7x the time of ``Sum`` +
    ``LayerNormalization`` at BERT-base's sizes (22 against 8.5 ms a call at (1, 512), 2 threads).
    The int8 graph is laid out the same way (``serving.int8_layout``). Returns how many."""
    count = 0
    for node in model.graph:
        if node.op_type != "Add" or node.domain or any(v is None or v.is_initializer() or v.const_value is not None
                                                       for v in node.inputs):
            continue
        uses = node.outputs[0].uses()
        if uses and all(use.node.op_type == "LayerNormalization" and not use.node.domain and use.idx == 0
                        for use in uses):
            node.op_type = "Sum"
            count += 1
    return count


def _save(model: ir.Model, path: str) -> None:
    folder, name = os.path.split(path)
    new = [v for v in model.graph.initializers.values()
           if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
           and v.const_value.nbytes > _EXTERNAL_MIN_BYTES]
    if new and any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()):
        moved = external_data.convert_tensors_to_external([v.const_value for v in new], folder, f"{name}.data")
        for value, tensor in zip(new, moved):
            value.const_value = tensor
    ir.save(model, path)
