"""Reduced-precision copies of a graph: dynamic int8 (CPU) and fp16 (CUDA).

int8: each ``MatMul`` whose second input is a constant 2-D weight becomes onnxruntime's dynamic
int8 form, in standard ONNX ops: the activations are quantized per call to uint8
(``DynamicQuantizeLinear``, once per tensor however many MatMuls read it), the weight is stored
as int8 with one symmetric scale per output column, and ``MatMulInteger`` + ``Cast`` + ``Mul``
compute the product, which onnxruntime fuses into one kernel (``DynamicQuantizeMatMul``). This is
U8S8 in the operator form, what onnxruntime recommends for transformers on x86 (S8S8 is slow
there). U8S8 saturates on x86 CPUs without VNNI: there the weights take 7 bits (``weight_codes``),
as onnxruntime's ``reduce_range`` does. Attention's products of two activations are quantized
too (both sides per call) on a CPU whose fp32 kernels lack AVX-512 (``activation_products_pay``).
Norms and softmax stay fp32. A ``Gemm``
with a constant weight (a 2-D ``nn.Linear``) is rewritten as ``MatMul`` + ``Add`` first, and
the graph is laid out so that onnxruntime keeps its fast kernels (``int8_layout``). The
weights are quantized here, vectorised (onnxruntime's own quantizer loops over channels in
Python: 18 s for BERT-base, against a few seconds here).

fp16: every float32 weight and op in float16, inputs and outputs kept float32 (casts at the
edges), so the caller's dtypes do not change.

Both read a graph file and write another; neither checks numbers: the caller measures how
closely the result agrees with its reference before serving it. No torch: a shipped fp32 graph
can be quantized on a box with onnxruntime only (``ModelGraph.quantized``).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import warnings
from typing import Any

import numpy as np

from serving import int8_layout

_TWO_GB = 2**31
_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")  # x86 flags of an int8 dot product that does not saturate


def quantize_int8(source: str, target: str, per_channel: bool = True, activation_products: bool | None = None) -> int:
    """Write ``source``'s graph with its MatMuls in dynamic int8 to ``target``: those over a
    constant weight, and with ``activation_products`` (by default where they pay on this CPU)
    those of two float32 activations (attention's), both sides quantized per call. Returns how
    many were quantized (0: nothing to quantize, ``target`` not written)."""
    import onnx

    if activation_products is None:
        activation_products = activation_products_pay()

    model = onnx.load(source)  # with its external data
    graph = model.graph
    _gemms_as_matmuls(graph)
    types = _value_types(model)  # laid out before quantizing: a weight a scaling folds into is quantized scaled
    int8_layout.scalings_folded(graph)
    int8_layout.residual_adds_as_sums(graph)
    if not activation_products:  # products in an If stay fp32
        int8_layout.attention_masks_branched(graph)
    weights = {t.name: t for t in graph.initializer}
    quantized: dict[str, tuple[str, str, str]] = {}  # fp32 weight -> (int8 weight, scale, zero point)
    activations: dict[str, tuple[str, str, str]] = {}  # fp32 activation -> its DynamicQuantizeLinear outputs
    nodes: list[Any] = []
    count = 0
    floats = {name for name, (elem_type, _) in types.items() if elem_type == onnx.TensorProto.FLOAT}
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and not node.domain else None
        if weight is None and activation_products and node.op_type == "MatMul" and not node.domain and \
                all(name in floats and name not in weights for name in node.input):
            for name in node.input:
                if name not in activations:
                    activations[name] = _quantized_activation(nodes, name)
            nodes += _integer_matmul(node, activations[node.input[0]], activations[node.input[1]])
            count += 1
            continue
        if weight is None or weight.data_type != onnx.TensorProto.FLOAT or len(weight.dims) != 2:
            nodes.append(node)
            continue
        if weight.name not in quantized:
            quantized[weight.name] = _quantized_weight(graph, weight, per_channel)
        if node.input[0] not in activations:
            activations[node.input[0]] = _quantized_activation(nodes, node.input[0])
        nodes += _integer_matmul(node, activations[node.input[0]], quantized[weight.name])
        count += 1
    if not count:
        return 0
    del graph.node[:]
    graph.node.extend(nodes)
    int8_layout.dead_nodes_dropped(graph)
    _drop_unused(graph)
    _save(model, target)
    return count


def _value_types(model: Any) -> dict[str, tuple[int, int | None]]:
    """Each value's element type and rank (None: unknown), by shape inference over the graph's
    structure alone (the weights stand in as typed inputs: no copy of their bytes)."""
    import onnx

    graph = model.graph
    skeleton = onnx.helper.make_model(
        onnx.helper.make_graph(list(graph.node), "types", [*graph.input, *(
            onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in graph.initializer)],
            list(graph.output)),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    inferred = onnx.shape_inference.infer_shapes(skeleton).graph
    return {v.name: (v.type.tensor_type.elem_type,
                     len(v.type.tensor_type.shape.dim) if v.type.tensor_type.HasField("shape") else None)
            for v in (*inferred.value_info, *inferred.input, *inferred.output)}


def _quantized_weight(graph: Any, weight: Any, per_channel: bool) -> tuple[str, str, str]:
    """The int8 weight, its scale and zero point (per column, or one), added to ``graph``'s initializers."""
    from onnx import numpy_helper

    values = numpy_helper.to_array(weight).astype(np.float32)
    largest = weight_codes()
    scale = np.abs(values).max(axis=0 if per_channel else None) / largest
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)  # an all-zero column: any scale
    codes = np.clip(np.rint(values / scale), -largest, largest).astype(np.int8)
    names = (f"{weight.name}_int8", f"{weight.name}_scale", f"{weight.name}_zero_point")
    for array, name in zip((codes, scale, np.zeros(scale.shape, np.int8)), names):
        graph.initializer.append(numpy_helper.from_array(array, name))
    return names


@functools.cache
def activation_products_pay() -> bool:
    """Whether attention's products of two activations run faster in int8 than in fp32 on this CPU:
    on an x86 CPU without AVX-512. Measured (BERT-base, 2 threads, weights in int8 either way): on
    an AVX2-only EPYC they were a third of the time left at sequence 512 and int8 cut it; on a Xeon
    with AVX-512 and AMX the fp32 products are at the fp32 peak and the int8 ones, with the scores
    quantized per call, ran slower at every size (onnxruntime's kernel time at (8, 128): 144-163
    against 176 ms; docs/BENCHMARKS.md, stop 36). Off x86: fp32 (unmeasured; fewer quantized
    products keep more precision)."""
    return _is_x86() and "avx512f" not in _cpu_flags()


@functools.cache
def weight_codes() -> int:
    """The largest int8 weight code (symmetric: -n..n): 127, or 63 on an x86 CPU without VNNI.
    There onnxruntime's uint8 x int8 kernel multiplies with ``vpmaddubsw``, which adds each pair of
    products into int16 and saturates past 32767: 255 * 127 * 2 does, 255 * 63 * 2 does not
    (onnxruntime's ``reduce_range``). Measured on an AVX2-only CPU: an MLP's int8 output agreed with
    fp32 at cosine 0.9916 with 8-bit weights, above 0.999 with 7-bit ones. An x86 machine whose
    flags cannot be read is taken to lack VNNI (7 bits cost a little precision, never a wrong sum)."""
    if not _is_x86():
        return 127  # ARM's int8 dot products accumulate in int32: no pair saturates
    return 127 if any(flag in _cpu_flags() for flag in _VNNI) else 63


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def _quantized_activation(nodes: list[Any], name: str) -> tuple[str, str, str]:
    from onnx import helper

    outputs = (f"{name}_uint8", f"{name}_uint8_scale", f"{name}_uint8_zero_point")
    nodes.append(helper.make_node("DynamicQuantizeLinear", [name], list(outputs), name=f"{name}_quantize"))
    return outputs


def _integer_matmul(node: Any, activation: tuple[str, str, str], weight: tuple[str, str, str]) -> list[Any]:
    """``node``'s product in integers, rescaled to float32 into its own output name."""
    from onnx import TensorProto, helper

    (a, a_scale, a_zero), (b, b_scale, b_zero) = activation, weight
    out, base = node.output[0], node.name or node.output[0]
    return [
        helper.make_node("Mul", [a_scale, b_scale], [f"{out}_scales"], name=f"{base}_scales"),
        helper.make_node("MatMulInteger", [a, b, a_zero, b_zero], [f"{out}_int32"], name=f"{base}_integer"),
        helper.make_node("Cast", [f"{out}_int32"], [f"{out}_float"], name=f"{base}_cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{out}_float", f"{out}_scales"], [out], name=f"{base}_rescale"),
    ]


def _gemms_as_matmuls(graph: Any) -> None:
    """Rewrite each ``Gemm`` with a constant weight (a 2-D ``nn.Linear``, as the exporter writes
    it) as ``MatMul`` + ``Add``."""
    from onnx import helper, numpy_helper

    weights = {t.name: t for t in graph.initializer}
    nodes = []
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0 and not attributes.get("transA", 0)
        if node.op_type != "Gemm" or node.domain or not plain or node.input[1] not in weights:
            nodes.append(node)
            continue
        weight = weights[node.input[1]]
        if attributes.get("transB", 0):
            transposed = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), f"{weight.name}_t")
            graph.initializer.append(transposed)
            weights[transposed.name] = weight = transposed
        biased = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}_matmul" if biased else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight.name], [product], name=f"{node.name}_matmul"))
        if biased:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_add"))
    del graph.node[:]
    graph.node.extend(nodes)


def _drop_unused(graph: Any) -> None:
    """Remove initializers no node reads any more (the fp32 weights that were quantized)."""
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for attribute_graph in (a.g for node in graph.node for a in node.attribute if a.HasField("g")):
        used |= {name for node in attribute_graph.node for name in node.input}  # read by a subgraph
    for tensor in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(tensor)


def _save(model: Any, target: str) -> None:
    import onnx

    large = sum(len(t.raw_data) for t in model.graph.initializer) > _TWO_GB - 2**26
    onnx.save_model(model, target, save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{os.path.basename(target)}.data", size_threshold=1024)


def to_fp16(source: str, target: str) -> int:
    """Write ``source``'s graph with float16 weights and compute to ``target``, inputs and outputs
    kept float32; return how many float32 weights were converted."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(source)
    before = sum(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer)
    logger = logging.getLogger("onnxruntime.transformers.float16")
    level = logger.level
    logger.setLevel(logging.ERROR)  # it logs each node it keeps in float32
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
    finally:
        logger.setLevel(level)
    _save(converted, target)
    return before
