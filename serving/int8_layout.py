"""Rewrites of a portable graph, before it is quantized, that keep onnxruntime's CPU kernels fast.

Each computes what it replaces, in standard ONNX ops; each removes work onnxruntime would do on
the exported transformer and Optimum's int8 export does not do, or does less of:

- a residual ``Add`` read by a ``LayerNormalization`` becomes ``Sum``: onnxruntime fuses
  ``Add`` + ``LayerNormalization`` into its ``SkipLayerNormalization``, whose CPU kernel is scalar
  code: 0.67 ms per layer at (1, 128, 768) against 0.28 ms for ``Sum`` + ``LayerNormalization``
  (2.2-3.7x at BERT-base's sizes, 2 threads). Optimum's export escapes half of these fusions (the
  shapes it leaves unknown), ours escaped none;
- torchlib's scalings of the queries and keys by the square root of the softmax scale go into the
  weights of their projections: two passes per layer fewer;
- attention's mask add and the product that zeroes the rows the mask hides
  (``exporters.translations``) run in an ``If``, only for a call whose mask hides something: the
  add is a pass over the (batch, heads, query, key) scores, 7.7% of BERT-base's int8 run at
  (1, 512), and a call with nothing masked (every sequence full, or one sequence alone) needs
  neither. Adding 0 and multiplying by 1 change no number, NaN and infinities included.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def residual_adds_as_sums(graph: Any) -> int:
    """Rewrite each ``Add`` of two computed values read only by ``LayerNormalization`` as ``Sum``
    (same values, broadcasting alike), so that onnxruntime does not fuse it into
    ``SkipLayerNormalization``. Returns how many."""
    constants = {t.name for t in graph.initializer}
    readers = _readers(graph)
    count = 0
    for node in graph.node:
        if node.op_type != "Add" or node.domain or any(name in constants for name in node.input):
            continue
        read_by = readers.get(node.output[0], [])
        if read_by and all(r.op_type == "LayerNormalization" and not r.domain and r.input[0] == node.output[0]
                           for r in read_by):
            node.op_type = "Sum"
            count += 1
    return count


def scalings_folded(graph: Any) -> int:
    """Fold each ``Mul`` by a constant scalar into the weight (and bias) of the ``MatMul`` whose
    product it scales, read through ``Reshape``/``Transpose`` (torchlib's scalings of attention's
    queries and keys): the scaled weight quantizes to the same int8 codes, only its scale
    changes. Returns how many."""
    from onnx import numpy_helper

    constants = {t.name: t for t in graph.initializer}
    produced = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    kept_names = {o.name for o in graph.output} | _subgraph_reads(graph)  # a product read there stays
    renamed, dropped = {}, set()
    for node in graph.node:
        factor = _scalar_factor(node, constants)
        if factor is None or node.output[0] in kept_names:
            continue
        scaled, value = factor
        product = _scaled_product(value, produced, readers, constants)
        if product is None:
            continue
        for reader, index in product:  # a scaled copy: the constant may be shared (deduplicated)
            name = reader.input[index]
            original = numpy_helper.to_array(constants[name])
            copy = numpy_helper.from_array((original * scaled).astype(original.dtype), f"{name}_scaled_{len(renamed)}")
            graph.initializer.append(copy)
            reader.input[index] = copy.name
        renamed[node.output[0]] = value
        dropped.add(id(node))
    if renamed:
        kept = [n for n in graph.node if id(n) not in dropped]
        for node in kept:
            for i, name in enumerate(node.input):
                node.input[i] = renamed.get(name, name)
        del graph.node[:]
        graph.node.extend(kept)
    return len(renamed)


def _scalar_factor(node: Any, constants: dict[str, Any]) -> tuple[np.ndarray, str] | None:
    """``(c, x)`` when ``node`` is ``Mul(x, c)`` or ``Mul(c, x)`` with ``c`` a constant float32 scalar."""
    from onnx import TensorProto, numpy_helper

    if node.op_type != "Mul" or node.domain or len(node.input) != 2:
        return None
    for factor, value in (node.input[1], node.input[0]), (node.input[0], node.input[1]):
        tensor = constants.get(factor)
        if tensor is not None and tensor.data_type == TensorProto.FLOAT and int(np.prod(tensor.dims)) == 1 \
                and value not in constants:
            return numpy_helper.to_array(tensor).reshape(()), value
    return None


def _scaled_product(value: str, produced: dict[str, Any], readers: dict[str, list[Any]],
                    constants: dict[str, Any]) -> list[tuple[Any, int]] | None:
    """Where the constant weight (and bias) of the ``MatMul`` (+ ``Add``) that ``value`` is a
    reshaped or transposed view of are read, as (node, input index), when every value on the way
    is read by the next step alone (or by ``Shape``, which a scaling does not change)."""
    node = produced.get(value)
    while node is not None and node.op_type in ("Reshape", "Transpose") and not node.domain:
        if not _read_by_one(node.output[0], readers):
            return None
        node = produced.get(node.input[0])
    if node is None or not _read_by_one(node.output[0], readers):
        return None
    scaled: list[tuple[Any, int]] = []
    if node.op_type == "Add" and not node.domain:
        biases = [i for i, name in enumerate(node.input) if name in constants]
        if len(biases) != 1:
            return None
        scaled = [(node, biases[0])]
        node = produced.get(node.input[1 - biases[0]])
        if node is None or not _read_by_one(node.output[0], readers):
            return None
    if node.op_type != "MatMul" or node.domain or node.input[1] not in constants:
        return None
    return [*scaled, (node, 1)]


def attention_masks_branched(graph: Any) -> int:
    """Replace each masked attention's ``Softmax(Add(scores, mask))``, its product with the values
    and the product zeroing hidden rows (``Mul(out, visible)``, all four made from one
    ``scaled_dot_product_attention`` call) by an ``If``: without the add and the zeroing when every
    entry of the mask is 0 and every row is visible, as before otherwise. One check per mask, read
    by every layer. Returns how many."""
    from onnx import helper

    produced = {o: n for n in graph.node for o in n.output}
    readers, outputs = _readers(graph), {o.name for o in graph.output}
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output]}
    replaced: dict[int, list[Any]] = {}  # id of the zeroing Mul -> the nodes in its place
    gone: set[int] = set()
    checks: dict[tuple[str, str], str] = {}
    for node in graph.node:
        chain = _masked_attention(node, produced, readers, outputs)
        if chain is None or not types.get(chain[-1].output[0]):
            continue
        add, softmax, product, zeroing = chain
        mask, visible = add.input[1], next(name for name in zeroing.input if name != product.output[0])
        out, made = zeroing.output[0], []
        if (mask, visible) not in checks:
            checks[mask, visible] = f"{out}_nothing_masked"
            made += _nothing_masked(mask, visible, checks[mask, visible])
        unmasked = _renamed([softmax, product], out, "unmasked", {add.output[0]: add.input[0]})  # softmax(scores)
        kept = helper.make_graph(unmasked, f"{out}_unmasked", [],
                                 [helper.make_tensor_value_info(f"{out}_unmasked", types[out], None)])
        masked = helper.make_graph(_renamed([add, softmax, product, zeroing], out, "masked"), f"{out}_masked", [],
                                   [helper.make_tensor_value_info(f"{out}_masked", types[out], None)])
        made.append(helper.make_node("If", [checks[mask, visible]], [out], name=f"{zeroing.name}_branched",
                                     then_branch=kept, else_branch=masked))
        replaced[id(zeroing)] = made
        gone |= {id(add), id(softmax), id(product)}
    if replaced:
        nodes = [made for n in graph.node if id(n) not in gone for made in replaced.get(id(n), [n])]
        del graph.node[:]
        graph.node.extend(nodes)
    return len(replaced)


def _masked_attention(softmax: Any, produced: dict[str, Any], readers: dict[str, list[Any]], outputs: set[str]
                      ) -> list[Any] | None:
    """The ``Add``, ``Softmax``, ``MatMul`` and zeroing ``Mul`` of one masked attention, when
    ``softmax`` is its softmax and each step is read by the next alone; else None."""
    if softmax.op_type != "Softmax" or softmax.domain:
        return None
    add = produced.get(softmax.input[0])
    scores = produced.get(add.input[0]) if add is not None and add.op_type == "Add" and not add.domain else None
    if scores is None or scores.op_type != "MatMul" or readers.get(add.output[0]) != [softmax]:
        return None
    (product, *others) = readers.get(softmax.output[0], [None])
    if others or product is None or product.op_type != "MatMul" or product.input[0] != softmax.output[0]:
        return None
    (zeroing, *others) = readers.get(product.output[0], [None])
    if others or zeroing is None or zeroing.op_type != "Mul" or zeroing.domain:
        return None
    chain = [add, softmax, product, zeroing]
    if any(n.output[0] in outputs for n in chain[:-1]):  # a value the graph hands out stays outside
        return None
    # The four from one torch attention: its mask cannot broadcast the scores to a larger shape.
    made_by = {_metadata(n, "pkg.torch.onnx.fx_node") for n in chain}
    if len(made_by) != 1 or "aten.scaled_dot_product_attention" not in made_by.pop():
        return None
    return chain


def _nothing_masked(mask: str, visible: str, name: str) -> list[Any]:
    """Nodes computing ``name``: every entry of ``mask`` is 0 and every one of ``visible`` is 1."""
    from onnx import TensorProto, helper

    nodes = []
    for value, target, tag in ((mask, 0.0, "zero"), (visible, 1.0, "one")):
        nodes += [
            helper.make_node("Constant", [], [f"{name}_{tag}"], value_float=target),
            helper.make_node("CastLike", [f"{name}_{tag}", value], [f"{name}_{tag}_like"]),
            helper.make_node("Equal", [value, f"{name}_{tag}_like"], [f"{name}_{tag}_equal"]),
            helper.make_node("Cast", [f"{name}_{tag}_equal"], [f"{name}_{tag}_float"], to=TensorProto.FLOAT),
            # The least is 1 when all are, 0 when one is not, +inf for no entries (then nothing is masked).
            helper.make_node("ReduceMin", [f"{name}_{tag}_float"], [f"{name}_{tag}_least"], keepdims=0),
            helper.make_node("Cast", [f"{name}_{tag}_least"], [f"{name}_{tag}_all"], to=TensorProto.BOOL),
        ]
    nodes.append(helper.make_node("And", [f"{name}_zero_all", f"{name}_one_all"], [name]))
    return nodes


def _renamed(chain: list[Any], out: str, branch: str, read: dict[str, str] | None = None) -> list[Any]:
    """Copies of ``chain``'s nodes for one branch, the last writing ``{out}_{branch}``: the values
    between them renamed so that no name is defined twice in the model, and those in ``read``
    read from another value."""
    from onnx import NodeProto

    names = {**(read or {}), **{n.output[0]: f"{out}_{branch}_{i}" for i, n in enumerate(chain[:-1])},
             chain[-1].output[0]: f"{out}_{branch}"}
    copies = []
    for node in chain:
        copy = NodeProto()
        copy.CopyFrom(node)
        copy.name = f"{node.name}_{branch}"
        copy.input[:] = [names.get(name, name) for name in node.input]
        copy.output[:] = [names[node.output[0]]]
        copies.append(copy)
    return copies


def _metadata(node: Any, key: str) -> str:
    return next((p.value for p in node.metadata_props if p.key == key), "")


def _read_by_one(name: str, readers: dict[str, list[Any]]) -> bool:
    return len([r for r in readers.get(name, []) if r.op_type != "Shape"]) == 1


def dead_nodes_dropped(graph: Any) -> int:
    """Remove nodes none of whose outputs is read (by a node, a subgraph or the graph's outputs),
    repeatedly. Returns how many."""
    dropped = 0
    while True:
        read = _read_names(graph) | {o.name for o in graph.output}
        kept = [n for n in graph.node if any(o in read for o in n.output if o)]
        if len(kept) == len(graph.node):
            return dropped
        dropped += len(graph.node) - len(kept)
        del graph.node[:]
        graph.node.extend(kept)


def _read_names(graph: Any) -> set[str]:
    return {name for node in graph.node for name in node.input} | _subgraph_reads(graph)


def _subgraph_reads(graph: Any) -> set[str]:
    names: set[str] = set()
    for subgraph in (a.g for node in graph.node for a in node.attribute if a.HasField("g")):
        names |= _read_names(subgraph)
    return names


def _readers(graph: Any) -> dict[str, list[Any]]:
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers
