"""Attention as served: rows that are all padding, and onnxruntime's fused kernels.

torch's ``scaled_dot_product_attention`` returns zeros for a query row whose boolean mask is all
False; the exporter's own translation returned the mean of the values there (exporters/translations.py).
Graphs with attention, layer norms or GELUs are served from a second file with onnxruntime's fused
kernels (exporters/fusion.py), while the graph handed out stays portable ONNX.
"""

from __future__ import annotations

import warnings

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from conftest import current

import clika_runtime as cr
import serving
from clika_runtime.capture import assembly, fusing
from clika_runtime.shipped.folder import GraphFolder


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64)).eval()


def _text(b: int, s: int, padded_rows: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(b * 100 + s))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[list(padded_rows)] = 0  # a row that is all padding: a batch filled up to a fixed size
    return {"input_ids": ids, "attention_mask": mask}


def _captured(model: torch.nn.Module):
    f = cr.compile(model)
    with torch.no_grad():
        f(**_text(2, 8))
        f(**_text(3, 16))  # the batch and sequence axes turn dynamic
    return model, f


@pytest.fixture(scope="module")
def bert():
    return _captured(_bert())


@pytest.fixture(scope="module")
def fused_bert():
    """Served from its fused graph whatever the timing says (a graph this small is timed, and
    onnxruntime's fused kernels do not always win at these sizes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fusing, "MEASURED_BELOW", 0)
        return _captured(_bert())


def _served_like_eager(model, f, inputs) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture given up would warn
        got, expected = f(**inputs), model(**inputs)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("served", ["bert", "fused_bert"])
def test_trap_a_row_of_padding_is_served_as_eager_computes_it(served, request):
    model, f = request.getfixturevalue(served)
    captures = f.recapture_count
    _served_like_eager(model, f, _text(3, 12, padded_rows=(1,)))
    _served_like_eager(model, f, _text(2, 5, padded_rows=(0, 1)))
    assert f.state is cr.CompiledFunction.State.Compiled and f.recapture_count == captures  # served by the dynamic graph


def test_trap_a_capture_from_a_call_with_a_padding_row_is_kept():
    """The capture's own call has an all-padding row: its verification used to fail, and the
    function then served eagerly for good."""
    model = _bert()
    f = cr.compile(model)
    _served_like_eager(model, f, _text(2, 8, padded_rows=(1,)))
    _served_like_eager(model, f, _text(2, 8, padded_rows=(0,)))
    assert f.state is cr.CompiledFunction.State.Compiled and f.fallback_reason is None


def test_trap_sdpa_with_a_fully_masked_boolean_row_returns_zeros():
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1, :, 2] = False  # query row 2 of batch 1 sees no key
    f = cr.compile(attend)
    f(q, k, v, mask)
    hits = current(f).stats.hits
    got = f(q, k, v, mask)
    assert current(f).stats.hits == hits + 1  # served by the graph
    torch.testing.assert_close(got, attend(q, k, v, mask))
    assert torch.count_nonzero(got[1, :, 2]) == 0


def test_a_cpu_graph_keeps_its_residual_adds_out_of_skip_layer_normalization(fused_bert):
    """onnxruntime's CPU SkipLayerNormalization is slower than Sum + LayerNormalization: the fused
    graph a CPU capture serves has attention fused and every layer norm plain, and its numbers are
    eager's (the fused_bert tests above). Before the test below takes its graph."""
    _, f = fused_bert
    folder = f._lifecycle.table.captures[0].folder
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder.path / "optimized_check.onnx")
    ort.InferenceSession(str(folder.opened), options, providers=["CPUExecutionProvider"])
    ops = [node.op_type for node in onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node]
    assert "MultiHeadAttention" in ops and "SkipLayerNormalization" not in ops, sorted(set(ops))
    assert ops.count("LayerNormalization") == 5  # the embeddings' and two per layer


def test_the_served_graph_is_fused_and_the_graph_handed_out_is_portable(fused_bert, tmp_path):
    _, f = fused_bert
    folder = current(f).folder
    fused = onnx.load(str(folder.path / GraphFolder.FUSED), load_external_data=False)
    domains = {node.domain for node in fused.graph.node}
    assert "com.microsoft" in domains, domains
    assert folder.opened == folder.path / GraphFolder.FUSED
    shipped = onnx.load(str(f.take_graph().save(tmp_path / "bert.onnx")))
    assert {node.domain for node in shipped.graph.node} <= {"", "ai.onnx"}


def test_each_attentions_keys_are_transposed_by_one_node(bert, tmp_path):
    """torchlib transposes attention's keys through a 3-D reshape, its shapes cut from ``Shape``
    (nine nodes); the graph handed out does it with one ``Transpose`` per attention
    (exporters/transposes.py), and serves eager's numbers (the fixtures' tests)."""
    _, f = bert
    graph = onnx.load(str(f.take_graph().save(tmp_path / "bert.onnx"))).graph
    swaps = [n for n in graph.node if n.op_type == "Transpose"
             and list(onnx.helper.get_attribute_value(n.attribute[0])) == [0, 1, 3, 2]]
    assert len(swaps) == 2  # one per layer
    keys = {n.input[0] for n in swaps}
    assert not [n for n in graph.node if n.op_type == "Shape" and n.input[0] in keys]  # their shapes unread


def test_graphs_without_a_fusion_are_served_from_their_portable_file():
    f = cr.compile(torch.nn.Linear(4, 3).eval())
    with torch.no_grad():
        f(torch.randn(2, 4))
    folder = current(f).folder
    assert folder.opened == folder.model and not (folder.path / GraphFolder.FUSED).exists()


def test_optimize_false_serves_the_graph_as_exported():
    model = _bert()
    f = cr.compile(model, optimize=False)
    _served_like_eager(model, f, _text(2, 8))
    folder = current(f).folder
    assert folder.opened == folder.model


def test_a_fused_graph_onnxruntime_refuses_falls_back_to_the_portable_one(tmp_path):
    """The rewriter wrote a graph onnxruntime could not open for GPT-2 small while this was built:
    the session opens the portable graph instead, and the fused file is dropped."""
    linear = torch.nn.Linear(4, 3).eval()
    proto = onnx.load_from_string(_exported(linear))
    folder = GraphFolder.write(proto, tmp_path)
    (folder.path / GraphFolder.FUSED).write_bytes(b"not a model")
    assert folder.opened != folder.model
    session = assembly.open_served(folder, serving.resolve("cpu"), optimize=True, keep_optimized=False)
    x = torch.randn(2, 4)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), linear(x).detach())
    assert folder.opened == folder.model and not (folder.path / GraphFolder.FUSED).exists()


def _exported(module: torch.nn.Module) -> bytes:
    f = cr.compile(module)
    with torch.no_grad():
        f(torch.randn(2, 4))
    return f.take_graph().model_proto.SerializeToString()


def _graph(slow: bool) -> onnx.ModelProto:
    """y = x + x; the slow one also adds 0 * (x @ x @ x), which onnxruntime cannot fold away."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", ["x", "x"], ["y" if not slow else "twice"])]
    if slow:
        nodes += [helper.make_node("MatMul", ["x", "x"], ["xx"]), helper.make_node("MatMul", ["xx", "x"], ["xxx"]),
                  helper.make_node("Mul", ["xxx", "zero"], ["nothing"]), helper.make_node("Add", ["twice", "nothing"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 256])],
                              [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("fused_is_slow", [True, False])
def test_a_small_graph_keeps_its_fused_file_only_when_it_runs_faster(tmp_path, fused_is_slow):
    folder = GraphFolder.write(_graph(slow=not fused_is_slow), tmp_path)
    onnx.save(_graph(slow=fused_is_slow), str(folder.path / GraphFolder.FUSED))
    x = torch.rand(256, 256, generator=torch.Generator().manual_seed(0))
    fusing.keep_if_faster(folder, serving.resolve("cpu"), ["x"], [x], threads=1)
    assert (folder.opened == folder.model) is fused_is_slow


def test_trap_sdpa_with_a_row_of_minus_infinity_in_a_float_mask_returns_zeros():
    """An additive mask (``masked_fill(~mask, -inf)``) over an all-padding row: torch returns
    zeros, the exporter's softmax NaN."""
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def batch(seed: int) -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(seed + i)) for i in range(3))
        mask = torch.zeros(2, 1, 1, 4)
        mask[0, ..., 2:] = float("-inf")  # right padding
        mask[1] = float("-inf")  # all padding
        return q, k, v, mask

    f = cr.compile(attend)
    f(*batch(0))  # the capture's own call has the row: it verifies
    hits = current(f).stats.hits
    args = batch(10)
    got = f(*args)
    assert current(f).stats.hits == hits + 1 and f.state is cr.CompiledFunction.State.Compiled
    torch.testing.assert_close(got, attend(*args))
    assert torch.count_nonzero(got[1]) == 0


def _encoder(norm: bool) -> torch.nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(16) if norm else None).eval()


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "final-norm"])
def test_trap_a_transformer_encoders_padded_positions_are_served_as_its_fast_path_leaves_them(norm):
    """In eval without grad, ``nn.TransformerEncoder`` runs padded batches as nested tensors and
    pads them back with zeros (before its final norm) where the padding is at the end of each row;
    a trace takes its other path, which computes those positions: a graph captured from an
    unpadded batch served them non-zero (1.8 off), a mean over every position differed."""
    model = _encoder(norm)
    f = cr.compile(model)
    x = torch.randn(2, 6, 16)
    at_end = torch.zeros(2, 6, dtype=torch.bool)
    at_end[1, 4:] = True
    at_start = torch.zeros(2, 6, dtype=torch.bool)
    at_start[1, :2] = True  # not left-aligned: eager's path computes every position
    with torch.inference_mode():
        f(x, src_key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
        for mask in (at_end, at_start, at_end):
            torch.testing.assert_close(f(x, src_key_padding_mask=mask), model(x, src_key_padding_mask=mask))
    assert sum(c.hits for c in f.captures) == 3 and f.recapture_count == 0


def test_trap_turning_the_attention_fast_path_off_is_a_change_of_state():
    """``torch.backends.mha.set_fastpath_enabled(False)`` after a capture: eager computes the
    padded positions the fast path left zero; the graph kept serving zeros (a trial: 2.37 off)."""
    model = _encoder(False)
    f = cr.compile(model)
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    try:
        with torch.inference_mode():
            f(x, src_key_padding_mask=mask), f(x, src_key_padding_mask=mask)
            torch.backends.mha.set_fastpath_enabled(False)
            torch.testing.assert_close(f(x, src_key_padding_mask=mask), model(x, src_key_padding_mask=mask))
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert f.recapture_reasons == ["state changed: torch's 'attention fast path'"]
