"""Max pooling at MaxPool's speed, a NaN still pooled as torch pools it.

torch's max pooling returns NaN for a window holding one; onnxruntime's MaxPool skips it, so our
translation (``translations.max_pool2d``) puts the NaN back: ``Where(IsNaN(AveragePool(x)), NaN,
MaxPool(x))``. That costs a second pass over every pool's input and, on x86, breaks
onnxruntime's blocked (NCHWc) layout around each pool: a pooling-heavy CNN's graph ran 1.25-1.36x
the time of the same model exported with MaxPool alone (docs/BENCHMARKS.md, "This stop: guarded
max pools...").

So a graph with such pools is served as one ``If``: the *fast* graph, each pool a bare MaxPool,
also averages each pool's input globally (``GlobalAveragePool``, which onnxruntime runs in the
blocked layout) and sums those averages into one number. That number is NaN when any pool's input
holds a NaN (a sum with a NaN in it is NaN; both infinities, or an average that overflows both
ways, make it NaN too, which only sends the call to the exact branch). When it is not NaN, no
window holds a NaN and MaxPool's answer is torch's: the fast graph's outputs are the answer. When
it is, the ``If`` runs the *exact* branch, the whole graph as exported, translations included, from
the graph's inputs. A NaN born inside the graph (``inf - inf`` in a convolution) is caught the
same way: the check reads each pool's input, not the graph's.
"""

from __future__ import annotations

import onnx_ir as ir

_FAST = ".fast"  # suffix of a fast output's value name: the If's output takes the output's own name
_EXACT = "exact."  # prefix of every value and node name in the exact branch (names are unique across scopes)


def guard_nan_pools(graph: ir.Graph) -> int:
    """Rewrite ``graph`` as described in the module docstring when it holds NaN-propagating float32
    max pools or adaptive average pools (``translations.adaptive_avg_pool2d``); returns how many
    pools the fast graph runs bare (0: the graph is left as it was)."""
    wheres = [node for node in graph if _is_nan_pool(node)]
    averages = [node for node in graph if _is_finite_average(node)]
    if not wheres + averages or any(_subgraphs(node) for node in graph):  # branches of its own: left exact
        return 0
    names = [value.name for value in graph.outputs]
    exact = _exact_branch(graph)
    pooled_inputs, products = [], []
    for where in wheres + averages:
        pooled = where.inputs[2]
        where.outputs[0].replace_all_uses_with(pooled, replace_graph_outputs=True)
        (pooled_inputs if where in wheres else products).append(pooled)
    pooled_inputs = [pooled.producer().inputs[0] for pooled in pooled_inputs]
    _drop_unused(graph)
    found = _either(graph, pooled_inputs and _nan_in_any(graph, pooled_inputs),
                    products and _not_finite_in_any(graph, products))
    fast = _fast_branch(graph)
    choose = ir.Node("", "If", [found], [ir.AttrGraph("then_branch", exact), ir.AttrGraph("else_branch", fast)],
                     num_outputs=len(names), name="nan_pool_guard")
    graph.append(choose)
    for i, (name, out) in enumerate(zip(names, choose.outputs)):
        unchecked = graph.outputs[i]
        out.name, out.dtype, out.shape = name, unchecked.dtype, unchecked.shape
        if unchecked.name == name:
            unchecked.name = name + _FAST
        graph.outputs[i] = out
    return len(wheres)


def _is_nan_pool(node: ir.Node) -> bool:
    """``Where(found, NaN, MaxPool(x))`` over float32: the NaN our max pooling puts back."""
    if node.op_type != "Where" or node.domain or len(node.inputs) != 3:
        return False
    _, nan, pooled = node.inputs
    producer = pooled.producer() if pooled is not None else None
    return (producer is not None and producer.op_type == "MaxPool" and not producer.domain
            and pooled.dtype == ir.DataType.FLOAT and _is_nan(nan))


def _is_finite_average(node: ir.Node) -> bool:
    """``Where(IsNaN(p) | IsInf(p), exact, p)`` with ``p`` a ``MatMul``: an adaptive average pool's
    product, served bare wherever it is finite (a NaN or inf in its input makes some of it not)."""
    if node.op_type != "Where" or node.domain or len(node.inputs) != 3:
        return False
    either, _, product = node.inputs
    test = either.producer() if either is not None else None
    if product is None or product.producer() is None or product.producer().op_type != "MatMul" or \
            test is None or test.op_type != "Or":
        return False
    kinds = sorted((v.producer().op_type, v.producer().inputs[0] is product)
                   if v is not None and v.producer() is not None else ("", False) for v in test.inputs)
    return kinds == [("IsInf", True), ("IsNaN", True)]


def _either(graph: ir.Graph, a: ir.Value | list, b: ir.Value | list) -> ir.Value:
    """``a or b`` of two bool scalars, where either may be missing (an empty list)."""
    if not isinstance(a, ir.Value) or not isinstance(b, ir.Value):
        return a if isinstance(a, ir.Value) else b
    found = _add(graph, "Or", [a, b])
    found.dtype, found.shape = ir.DataType.BOOL, ir.Shape([])
    return found


def _not_finite_in_any(graph: ir.Graph, products: list[ir.Value]) -> ir.Value:
    """A bool scalar: whether any of ``products`` holds a NaN or an inf (their sum is not finite
    then; a sum that overflows only sends the call to the exact branch)."""
    sums = [_add(graph, "ReduceSum", [p], [ir.AttrInt64("keepdims", 0)]) for p in dict.fromkeys(products)]
    sums = [s if s.dtype == ir.DataType.FLOAT else _cast(graph, s, ir.DataType.FLOAT) for s in sums]
    total = sums[0] if len(sums) == 1 else _add(graph, "Sum", sums)
    nan, infinite = _add(graph, "IsNaN", [total]), _add(graph, "IsInf", [total])
    for value in (nan, infinite):
        value.dtype, value.shape = ir.DataType.BOOL, ir.Shape([])
    return _either(graph, nan, infinite)


def _cast(graph: ir.Graph, value: ir.Value, to: ir.DataType) -> ir.Value:
    out = _add(graph, "Cast", [value], [ir.AttrInt64("to", to)])
    out.dtype = to
    return out


def _is_nan(value: ir.Value | None) -> bool:
    """A scalar constant NaN (an initializer, or a ``Constant`` node's output)."""
    if value is None:
        return False
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attribute = value.producer().attributes.get("value")
        tensor = attribute.value if attribute is not None else None
    if tensor is None or tensor.size != 1:
        return False
    array = tensor.numpy()
    return bool(array.dtype.kind == "f" and (array != array).all())


def _subgraphs(node: ir.Node) -> bool:
    return any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values())


def _exact_branch(graph: ir.Graph) -> ir.Graph:
    """Every node of ``graph`` again, reading its inputs and initializers from the outer scope."""
    copies: dict[int, ir.Value] = {}  # original value -> its copy in the branch
    nodes = []
    for node in graph:
        inputs = [None if v is None else copies.get(id(v), v) for v in node.inputs]
        attributes = [_copied(attr) for attr in node.attributes.values()]
        copy = ir.Node(node.domain, node.op_type, inputs, attributes, overload=node.overload,
                       num_outputs=len(node.outputs), version=node.version,
                       name=_EXACT + node.name if node.name else None)
        for original, made in zip(node.outputs, copy.outputs):
            made.name = _EXACT + (original.name or f"value{len(copies)}")
            made.dtype, made.shape = original.dtype, original.shape
            copies[id(original)] = made
        nodes.append(copy)
    outputs = [copies.get(id(v)) or _identity_into(nodes, v, _EXACT) for v in graph.outputs]
    return ir.Graph([], outputs, nodes=nodes, name="exact")


def _copied(attr: ir.Attr) -> ir.Attr:
    return ir.Attr(attr.name, attr.type, attr.value, doc_string=attr.doc_string)


def _fast_branch(graph: ir.Graph) -> ir.Graph:
    """The outer graph's outputs, passed through (a branch's outputs are values of its own)."""
    nodes: list[ir.Node] = []
    return ir.Graph([], [_identity_into(nodes, v, "fast.") for v in graph.outputs], nodes=nodes, name="fast")


def _identity_into(nodes: list[ir.Node], value: ir.Value, prefix: str) -> ir.Value:
    node = ir.Node("", "Identity", [value], num_outputs=1)
    out = node.outputs[0]
    out.name, out.dtype, out.shape = prefix + (value.name or "value"), value.dtype, value.shape
    nodes.append(node)
    return out


def _nan_in_any(graph: ir.Graph, pooled_inputs: list[ir.Value]) -> ir.Value:
    """A bool scalar: whether any of ``pooled_inputs`` may hold a NaN (its global average is NaN).
    Averages of same-batch 4-D inputs are concatenated along channels first: onnxruntime keeps them
    in its blocked layout, and one sum is fewer nodes than one per pool (each costs ~1 us a run)."""
    averages = [_add(graph, "GlobalAveragePool", [x]) for x in dict.fromkeys(pooled_inputs)]  # each tensor once
    batches = {str(x.shape[0]) if x.shape is not None and len(x.shape) == 4 else None for x in pooled_inputs}
    if len(averages) > 1 and None not in batches and len(batches) == 1:
        averages = [_add(graph, "Concat", averages, [ir.AttrInt64("axis", 1)])]
    sums = [_add(graph, "ReduceSum", [average], [ir.AttrInt64("keepdims", 0)]) for average in averages]
    total = sums[0] if len(sums) == 1 else _add(graph, "Sum", sums)
    found = _add(graph, "IsNaN", [total])
    found.dtype, found.shape = ir.DataType.BOOL, ir.Shape([])
    return found


def _add(graph: ir.Graph, op_type: str, inputs: list[ir.Value], attributes: list[ir.Attr] = ()) -> ir.Value:
    node = ir.Node("", op_type, inputs, attributes, num_outputs=1)
    graph.append(node)
    out = node.outputs[0]
    out.dtype = inputs[0].dtype
    return out


def _drop_unused(graph: ir.Graph) -> None:
    """Remove nodes none of whose outputs is read or returned (the fast graph's NaN windows)."""
    for node in reversed(list(graph)):
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)
