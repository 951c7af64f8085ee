"""Reduced-precision copies of an exported graph: onnxruntime's dynamic int8, and fp16.

int8 (CPU): weights stored as int8 and each MatMul's activations quantized per call to uint8
(``DynamicQuantizeLinear`` + ``MatMulInteger``, which onnxruntime fuses into one kernel), the form
onnxruntime recommends for transformers on x86 (U8S8: uint8 activations, int8 weights, in the
operator form; S8S8 is slow there). Only MatMuls with a constant weight are quantized: attention's
products of two activations stay fp32, as do layer norms and softmax. Quantizing the graph with
onnxruntime's fused kernels (exporters.fusion) keeps attention fused at long sequences.

fp16 (CUDA): every float32 weight and op in float16, the inputs and outputs kept float32 (casts
at the edges), so the caller's dtypes do not change.

Both read a graph file and write another; neither checks numbers: the caller measures how
closely the result agrees with its reference before serving it. Here, not in exporters/, because
they take any ONNX graph and need no torch: a shipped fp32 graph can be quantized on a box
without it (``ModelGraph.quantized``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator

# The ops onnxruntime's dynamic quantization turns into integer ops that run faster on x86.
# Conv (ConvInteger) and Gather (embeddings) are left fp32: ConvInteger runs slower than fp32
# Conv on onnxruntime's CPU provider, and a quantized embedding adds error for no speed.
INT8_OPS = ("MatMul", "Attention")
_TWO_GB = 2**31


def quantize_int8(source: str, target: str, *, per_channel: bool = True) -> int:
    """Write ``source``'s graph with onnxruntime's dynamic int8 quantization to ``target``; return
    how many ops were quantized (0: nothing to quantize, ``target`` not written)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(source)  # with its external data
    _gemms_as_matmuls(model)
    if not any(node.op_type in INT8_OPS for node in model.graph.node):
        return 0
    large = not _fits_proto(model)  # the int8 graph is smaller, but keep a large one's layout
    with _quantizer_quiet():
        quantize_dynamic(model, target, weight_type=QuantType.QInt8, per_channel=per_channel,
                         op_types_to_quantize=list(INT8_OPS), use_external_data_format=large,
                         extra_options={"MatMulConstBOnly": True})
    written = onnx.load(target, load_external_data=False)
    return sum(node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul", "QAttention") for node in written.graph.node)


def _gemms_as_matmuls(model: object) -> None:
    """Rewrite each ``Gemm`` with a constant weight (a 2-D ``nn.Linear``, as the exporter writes it)
    as ``MatMul`` + ``Add``, which dynamic quantization takes (it has no integer Gemm)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph  # type: ignore[attr-defined]
    weights = {t.name: t for t in graph.initializer}
    nodes = []
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0 and not attributes.get("transA", 0)
        if node.op_type != "Gemm" or not plain or node.input[1] not in weights:
            nodes.append(node)
            continue
        weight = weights[node.input[1]]
        if attributes.get("transB", 0):
            transposed = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), f"{weight.name}_t")
            graph.initializer.append(transposed)
            weights[transposed.name] = transposed
            weight = transposed
        product = f"{node.output[0]}_matmul" if len(node.input) > 2 and node.input[2] else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight.name], [product], name=f"{node.name}_matmul"))
        if product != node.output[0]:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_add"))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    unused = [t for t in graph.initializer if t.name not in used]  # the untransposed weights
    for tensor in unused:
        graph.initializer.remove(tensor)
    onnx.checker.check_model(model)  # type: ignore[arg-type]


def to_fp16(source: str, target: str) -> int:
    """Write ``source``'s graph with float16 weights and compute to ``target``, inputs and outputs
    kept float32; return how many float32 tensors were converted."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(source)
    before = sum(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer)
    with _quantizer_quiet():
        converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
    onnx.save_model(converted, target, save_as_external_data=not _fits_proto(converted),
                    location=f"{os.path.basename(target)}.data")
    return before


def _fits_proto(model: object) -> bool:
    try:
        return model.ByteSize() < _TWO_GB  # type: ignore[attr-defined]
    except Exception:  # protobuf refuses to size a message past 2 GB
        return False


@contextlib.contextmanager
def _quantizer_quiet() -> Iterator[None]:
    """onnxruntime's quantizer logs through the root logger with ``logging.warning`` (a shape it
    could not infer, advice to pre-process), which installs a console handler on the root
    logger when none is there: keep both off the user's console while it runs (and its
    warnings). The root logger's level is process-wide: other threads' root records are held
    back for the few seconds it runs."""
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    added = not root.handlers
    if added:
        root.addHandler(placeholder)  # logging.warning() then sees a handler and leaves the root alone
    level = root.level
    root.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)
        if added:
            root.removeHandler(placeholder)
