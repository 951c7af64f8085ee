"""Ship and validate: ModelGraph, save/load, torch-free serving, the CLI and the testing helper."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import clika_runtime as cr
from clika_runtime import GraphFileError, GraphInputError
from clika_runtime.cli import main as cli
from clika_runtime.shipped.validation import save_reference
from clika_runtime.testing import assert_graph_matches_eager


class Heads(NamedTuple):
    logits: torch.Tensor
    length: int


class Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, tokens, mode="tags", extra=None):
        h = self.embed(tokens)
        out = {"heads": Heads(self.head(h), tokens.shape[1]), "mode": mode}
        if extra is not None:
            out["pooled"] = (h * extra["scale"][..., None]).mean(1)
        return out


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    model = Tagger().eval()
    f = cr.compile(model)
    tokens = torch.randint(0, 10, (2, 5))
    with torch.no_grad():
        f(tokens, extra={"scale": torch.ones(2, 5)})
        f(torch.randint(0, 10, (2, 7)), extra={"scale": torch.ones(2, 7)})  # sequence axis dynamic
    graph = f.take_graph()
    folder = tmp_path_factory.mktemp("ship")
    return model, graph, graph.save(folder / "tagger.onnx"), folder


def _expected(model, tokens, scale):
    with torch.no_grad():
        return model(tokens, extra={"scale": scale})


def test_model_graph_describes_itself(shipped):
    _, graph, _, _ = shipped
    assert graph.input_names == ["tokens", "extra_scale"]
    assert graph.output_names == ["heads_logits", "heads_length", "pooled"]
    assert graph.dynamic_axes["tokens"] == {1: "tokens_dim1"}
    meta = {p.key: p.value for p in graph.model_proto.metadata_props}
    assert meta["clika_runtime.version"] == cr.__version__
    assert json.loads(meta["clika_runtime.dims"])["tokens"] == [2, "tokens_dim1"]


def test_saved_graph_passes_the_full_checker_and_runs_in_plain_onnxruntime(shipped):
    model, _, path, _ = shipped
    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    tokens, scale = torch.randint(0, 10, (2, 9)), torch.rand(2, 9)
    logits, length, pooled = session.run(None, {"tokens": tokens.numpy(), "extra_scale": scale.numpy()})
    expected = _expected(model, tokens, scale)
    np.testing.assert_allclose(logits, expected["heads"].logits.numpy(), rtol=1e-4, atol=1e-5)
    assert int(length) == 9


def test_load_serves_the_same_pytrees_torch_in_torch_out(shipped):
    model, _, path, _ = shipped
    served = cr.load(path, place="cpu", output_types=[Heads])  # Heads is no registered node: allowed by name
    tokens, scale = torch.randint(0, 10, (2, 4)), torch.rand(2, 4)
    out = served(tokens, extra={"scale": scale})
    expected = _expected(model, tokens, scale)
    assert list(out) == ["heads", "mode", "pooled"] and out["mode"] == "tags"
    assert type(out["heads"]) is Heads and out["heads"].length == 4
    assert isinstance(out["pooled"], torch.Tensor)
    torch.testing.assert_close(out["pooled"], expected["pooled"])
    numpy_out = served(tokens.numpy(), extra={"scale": scale.numpy()})
    assert isinstance(numpy_out["pooled"], np.ndarray)


def test_load_rejects_a_changed_static_value_and_bad_inputs(shipped):
    _, _, path, _ = shipped
    served = cr.load(path)
    tokens, scale = np.zeros((2, 3), dtype=np.int64), np.ones((2, 3), dtype=np.float32)
    with pytest.raises(GraphInputError, match=r"input mode: the graph was captured with the static value 'tags', got 'x'"):
        served(tokens, "x", extra={"scale": scale})
    with pytest.raises(GraphInputError, match=r"input 'tokens': expected dtype int64, got float32"):
        served(tokens.astype(np.float32), extra={"scale": scale})
    with pytest.raises(GraphInputError, match=r"input 'extra_scale': expected rank 2 \[2, tokens_dim1\], got shape \(3,\)"):
        served(tokens, extra={"scale": scale[0]})
    with pytest.raises(GraphInputError, match=r"input 'tokens' axis 0: expected size 2"):
        served(np.zeros((5, 3), dtype=np.int64), extra={"scale": np.ones((5, 3), dtype=np.float32)})
    with pytest.raises(GraphInputError, match=r"extra\['scale'\]: missing"):
        served(tokens, extra={"other": scale})
    # Size 0 on a dynamic axis: the trace assumed it away, and a shipped graph has no tracer to ask.
    with pytest.raises(GraphInputError, match=r"input 'tokens' axis 1: size 0, which the trace assumed away"):
        served(np.zeros((2, 0), dtype=np.int64), extra={"scale": np.ones((2, 0), dtype=np.float32)})


def test_load_works_without_torch_optree_or_onnx(shipped):
    _, _, path, _ = shipped
    script = textwrap.dedent(f"""
        import sys
        for name in ("torch", "optree", "onnx", "transformers"):
            sys.modules[name] = None  # any import of these now fails
        import numpy as np
        import clika_runtime as cr
        served = cr.load({str(path)!r})
        out = served(np.zeros((2, 6), dtype=np.int64), extra={{"scale": np.ones((2, 6), dtype=np.float32)}})
        heads = out["heads"]
        print(type(heads).__name__, heads[0].shape, heads[1], out["pooled"].dtype, out["mode"])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Heads lives in this test module, not importable there: it comes back as its fields in order.
    assert result.stdout.split() == ["tuple", "(2,", "6,", "3)", "6", "float32", "tags"]


def test_external_data_on_request_and_model_graph_load(shipped, tmp_path):
    model, graph, _, _ = shipped
    path = graph.save(tmp_path / "ext.onnx", external_data=True)
    data = _data_file(path)  # named after the content: ext.onnx.<16 hex digits>.data
    size = data.stat().st_size
    graph.save(tmp_path / "ext.onnx", external_data=True)  # saved again over itself: replaced, not appended
    assert _data_file(path) == data and data.stat().st_size == size
    assert graph.model_proto.graph.initializer[0].data_location == onnx.TensorProto.DEFAULT  # proto untouched
    loaded = cr.ModelGraph.load(path)
    assert loaded.input_names == graph.input_names and loaded.output_names == graph.output_names
    served = loaded.serve("cpu")
    tokens, scale = torch.randint(0, 10, (2, 3)), torch.rand(2, 3)
    torch.testing.assert_close(served(tokens, extra={"scale": scale})["pooled"], _expected(model, tokens, scale)["pooled"])


def _data_file(model: Path) -> Path:
    """The one external data file a save wrote beside ``model``."""
    (data,) = model.parent.glob(f"{model.name}.*.data")
    return data


def test_broken_files_give_clear_errors(shipped, tmp_path):
    _, graph, path, _ = shipped
    with pytest.raises(GraphFileError, match="no such file"):
        cr.load(tmp_path / "missing.onnx")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GraphFileError, match="truncated or corrupt"):
        cr.load(truncated)
    with pytest.raises(GraphFileError, match="truncated or corrupt"):
        cr.ModelGraph.load(truncated)
    ext = graph.save(tmp_path / "ext.onnx", external_data=True)
    _data_file(ext).unlink()
    with pytest.raises(GraphFileError, match="external data"):
        cr.load(ext)


def _spread(x):
    if x.shape[0] > 1:
        return x.std(0)
    return torch.zeros_like(x[0])


def test_take_graph_hands_out_the_general_graph_not_a_size_one_variant(tmp_path):
    # The last warm-up call was batch 1: the graph last served was the batch-1 variant, which
    # rejected every other batch once shipped.
    f = cr.compile(_spread)
    for rows in (4, 8, 6, 1):
        f(torch.randn(rows, 3))
    assert len(f.captures) == 2
    f.take_graph().save(tmp_path / "model.onnx")
    served, x = cr.load(tmp_path / "model.onnx"), torch.randn(5, 3)
    torch.testing.assert_close(served(x), _spread(x))


def test_plain_onnx_from_elsewhere_loads_flat_by_name(tmp_path):
    from onnx import TensorProto, helper

    node = helper.make_node("Add", ["a", "b"], ["sum"])
    graph = helper.make_graph([node], "plain", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in "ab"],
                              [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["n"])])
    path = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    served = cr.load(path)
    out = served(np.ones(3, np.float32), b=np.ones(3, np.float32))
    np.testing.assert_array_equal(out["sum"], np.full(3, 2.0, np.float32))
    with pytest.raises(GraphInputError, match=r"graph inputs are \['a', 'b'\]; missing \['b'\]"):
        served(np.ones(3, np.float32))


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_inspect_table_and_json(shipped, capsys):
    _, _, path, _ = shipped
    assert cli(["inspect", str(path)]) == 0
    table = capsys.readouterr().out
    assert "tokens" in table and "tokens_dim1" in table and "Gather" in table
    assert cli(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["inputs"][0] == {"name": "tokens", "dtype": "int64", "dims": [2, "tokens_dim1"]}
    assert info["nodes"] > 0 and "clika_runtime.outputs" in info["metadata"]


def test_cli_validate_passes_fails_and_rejects_unknown_dims(shipped, capsys, tmp_path):
    model, _, path, _ = shipped
    assert cli(["validate", str(path), "--dims", "tokens_dim1=1,4,16"]) == 0
    out = capsys.readouterr().out
    assert "runs at tokens_dim1=16" in out and out.strip().endswith("passed, 0 failed")
    tokens, scale = torch.randint(0, 10, (2, 6)), torch.rand(2, 6)
    expected = _expected(model, tokens, scale)
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    inputs = {"tokens": tokens, "extra_scale": scale}
    save_reference(good, inputs, {"pooled": expected["pooled"]})
    save_reference(bad, inputs, {"pooled": expected["pooled"] + 1})
    assert cli(["validate", str(path), "--reference", str(good)]) == 0
    assert cli(["validate", str(path), "--reference", str(bad)]) == 1
    assert "output 'pooled': max |diff| 1" in capsys.readouterr().out
    # A reference that lacks an input does not fit the graph, as one of the wrong size does: exit 2.
    partial = tmp_path / "partial.npz"
    save_reference(partial, {"tokens": tokens}, {"pooled": expected["pooled"]})
    assert cli(["validate", str(path), "--reference", str(partial)]) == 2
    assert "lacks input(s) ['extra_scale']" in capsys.readouterr().err
    assert cli(["validate", str(path), "--dims", "seq=1,2"]) == 2
    assert "unknown dim name(s) ['seq']; this graph's dynamic dims are ['tokens_dim1']" in capsys.readouterr().err
    # The flag repeats (each kept; it used to keep the last only), and a dim given twice is refused.
    assert cli(["validate", str(path), "--dims", "tokens_dim1=5", "--dims", "seq=1"]) == 2
    assert "unknown dim name(s) ['seq']" in capsys.readouterr().err
    assert cli(["validate", str(path), "--dims", "tokens_dim1=5", "--dims", "tokens_dim1=7"]) == 2
    assert "--dims: tokens_dim1 given twice (5 and 7)" in capsys.readouterr().err


def test_cli_validate_reports_a_broken_graph(tmp_path, capsys):
    # A readable graph that fails a check is exit 1; bytes that are no graph are unusable input
    # (exit 2: tests/test_messages.py).
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "broken", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    broken = tmp_path / "broken.onnx"
    onnx.save(helper.make_model(graph), broken)
    assert cli(["validate", str(broken)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"readable, reads only files in its folder  ok", out)
    assert re.search(r"onnx checker \(full\)  +FAIL  .*NoSuchOp", out), out


def test_cli_validate_of_a_folder_that_is_no_triton_model_is_a_usage_error(tmp_path, capsys):
    assert cli(["validate", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path}: a folder without config.pbtxt: give an .onnx file or a Triton model folder")


def test_cli_export_from_factories_and_from_a_signature(tmp_path, monkeypatch, capsys):
    (tmp_path / "zoo_models.py").write_text(textwrap.dedent("""
        import torch
        def model():
            return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
        def example():
            return (torch.randn(3, 8),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "a.onnx"
    assert cli(["export", "zoo_models:model", "--inputs", "zoo_models:example", "--out", str(out)]) == 0
    assert cr.ModelGraph.load(out).input_names == ["input"]
    out = tmp_path / "b.onnx"
    assert cli(["export", "zoo_models:model", "--signature", "x:float32[batch,8]", "--out", str(out)]) == 0
    graph = cr.ModelGraph.load(out)
    assert graph.input_names == ["x"] and graph.dynamic_axes["x"] == {0: "batch"}
    assert cli(["export", "zoo_models:nothing", "--signature", "x:float32[2]", "--out", str(out)]) == 2
    assert "has no attribute nothing" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ testing helper


def test_testing_helper_passes_for_a_faithful_graph():
    f = assert_graph_matches_eager(torch.nn.GELU(), [(torch.randn(2, 3),), (torch.randn(5, 3),)])
    assert f.recapture_count == 1


def test_testing_helper_names_the_output_and_worst_difference():
    def noisy(x):  # onnxruntime's softmax rounds differently from torch's (its own exp, its own sum order)
        return {"clean": x * 2, "noisy": torch.softmax(x, -1)}

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match=r"example 0: output 'noisy' differs from eager \(worst \|diff\| [0-9.e-]+\)"):
        assert_graph_matches_eager(noisy, [x], rtol=0.0, atol=0.0)


def test_testing_helper_says_why_a_function_did_not_compile():
    with pytest.raises(AssertionError, match=r"did not compile: .*draws random numbers"), \
            pytest.warns(UserWarning, match="draws random numbers"):
        assert_graph_matches_eager(lambda x: x + torch.rand_like(x), [torch.zeros(5)])


@pytest.mark.parametrize("refused_first", [True, False])
def test_trap_the_testing_helper_fails_an_example_no_graph_served(refused_first):
    def scale(x, in_place):  # the in-place key writes its input: it serves eagerly, never by a graph
        if in_place:
            x.mul_(1.0)
        return x * 2

    examples = [(torch.randn(4), True), (torch.randn(4), False)]
    with pytest.raises(AssertionError, match=r"example \d was not served by a graph: input mutation: .* in place"), \
            pytest.warns(UserWarning):
        assert_graph_matches_eager(scale, examples if refused_first else examples[::-1])


def test_the_testing_helper_judges_an_int8_graph_by_its_agreement_and_says_why_a_call_recaptured():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).eval()
    # int8 differs from eager by more than float32's tolerance, by design: judged by its agreement.
    assert_graph_matches_eager(model, [(torch.randn(4, 8),), (torch.randn(4, 8),)], precision="int8")
    previous = cr.config.cache_size
    cr.config.cache_size = 1  # the second dtype evicts the first: the second pass re-captures, said so
    try:
        with pytest.raises(AssertionError, match=r"not all served by one set of graphs: example 0 re-captured: "
                                                 r"\[\"input 'x' changed: float64"):
            assert_graph_matches_eager(lambda x: x * 2, [torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64)])
    finally:
        cr.config.cache_size = previous


def test_loaded_graph_takes_lifted_numbers_and_bfloat16_outputs(tmp_path):
    f = cr.compile(lambda x, k: ((x[:k] * 2).bfloat16(), k), specialize=False)
    x = torch.arange(5.0)
    f(x, 3)
    served = cr.load(f.take_graph().save(tmp_path / "lifted.onnx"))
    out, k = served(x, 2)
    assert out.dtype == torch.bfloat16 and k == 2
    torch.testing.assert_close(out, (x[:2] * 2).bfloat16())
    with pytest.raises(GraphInputError, match=r"\['out_0'\] are bfloat16, which numpy cannot hold: call with torch tensors"):
        served(x.numpy(), 4)


def test_loaded_graph_takes_python_numbers_with_numpy_arrays(tmp_path):
    f = cr.compile(lambda x, k: x[:k] + k, specialize=False)
    f(torch.arange(5.0), 3)
    served = cr.load(f.take_graph().save(tmp_path / "numbers.onnx"))
    np.testing.assert_array_equal(served(np.arange(5.0, dtype=np.float32), 2), np.array([2.0, 3.0], np.float32))


def test_loaded_graph_returns_torch_structseqs(tmp_path):
    f = cr.compile(lambda x: torch.max(x, 1))
    x = torch.randn(2, 3)
    f(x)
    out = cr.load(f.take_graph().save(tmp_path / "max.onnx"))(x)  # torch.return_types.max: a registered node
    assert type(out) is torch.return_types.max
    torch.testing.assert_close(out.values, torch.max(x, 1).values)


def test_console_script_and_module_entry_point(shipped):
    _, _, path, _ = shipped
    script = Path(sys.executable).parent / "clika-runtime"
    for command in ([str(script)], [sys.executable, "-m", "clika_runtime"]):
        result = subprocess.run(command + ["inspect", str(path), "--json"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["graph_name"] == "Tagger"


def test_models_past_the_protobuf_limit_use_external_data_everywhere(tmp_path, monkeypatch):
    from clika_runtime.format import graphfile

    monkeypatch.setattr(graphfile, "_PROTOBUF_LIMIT", 1024)  # a 64x64 linear layer is past it now
    model = torch.nn.Linear(64, 64).eval()
    f = cr.compile(model)
    x = torch.randn(2, 64)
    with torch.no_grad():
        f(x)
        torch.testing.assert_close(f(x), model(x))  # served from a session opened on external data
        graph = f.take_graph()
    path = graph.save(tmp_path / "big.onnx")
    assert _data_file(path).is_file()  # external data chosen automatically
    with torch.no_grad():
        torch.testing.assert_close(cr.load(path)(x), model(x))
        torch.testing.assert_close(graph.serve()(x), model(x))


# ------------------------------------------------------------------------ unusual arrays and tensors


def _served_linear(tmp_path, *rows: int, dtype: torch.dtype = torch.float32):
    """A tiny linear graph, served from its file: one call per row count (two: a dynamic batch,
    outputs of unknown shape, the numpy path; one: fixed-shape outputs, the reused binding)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).eval()
    f = cr.compile(lambda x: model(x.float()))
    with torch.no_grad():
        for n in rows:
            f(torch.randn(n, 8).to(dtype))
    return model, cr.load(f.take_graph().save(tmp_path / "linear.onnx"), place="cpu")


def test_trap_loaded_graph_serves_a_big_endian_array_by_its_values(tmp_path):
    # '>f4' passed the float32 check and onnxruntime read its bytes little-endian (values ~1e37).
    model, served = _served_linear(tmp_path, 3, 5)
    x = np.random.RandomState(0).randn(4, 8).astype(">f4")
    with torch.no_grad():
        expected = model(torch.from_numpy(x.astype("=f4"))).numpy()
    np.testing.assert_allclose(served(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served.run({served.input_names[0]: x})[served.output_names[0]], expected,
                               rtol=1e-5, atol=1e-6)
    assert x.dtype == np.dtype(">f4")  # the caller's array is left as it was


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("rows", [(3, 5), (4,)], ids=["numpy path", "reused binding"])
def test_trap_loaded_graph_refuses_meta_sparse_and_subclass_tensors_by_name(tmp_path, rows):
    # They got "onnxruntime failed running the graph" with torch's numpy-conversion text (a meta
    # tensor crashed the process on the reused binding, which read its null pointer).
    _, served = _served_linear(tmp_path, *rows)
    name, x = served.input_names[0], torch.randn(4, 8)
    for bad, got in [(x.to("meta"), "a tensor on meta"), (x.to_sparse(), "a torch.sparse_coo tensor"),
                     (x.to_sparse_csr(), "a torch.sparse_csr tensor"), (x.as_subclass(_Sub), "a _Sub")]:
        with pytest.raises(GraphInputError, match=rf"input '{name}': expected a dense strided torch.Tensor on cpu.*, "
                                                  rf"got {re.escape(got)}"):
            served(bad)
    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.nested_tensor([x[0], x[1]], layout=layout)
        with pytest.raises(GraphInputError, match=rf"input '{name}'"):  # by its layout, or its ragged size
            served(nested)  # it raised the guard's RuntimeError ("NestedTensorImpl doesn't support sizes")
    torch.testing.assert_close(served(torch.nn.Parameter(x)), served(x))  # a Parameter is a plain tensor


@pytest.mark.parametrize("rows, dtype", [((3, 5), torch.float32), ((4,), torch.float32), ((3, 5), torch.bfloat16)],
                         ids=["numpy path", "reused binding", "dlpack"])
def test_trap_loaded_graph_serves_negative_views_by_their_values(tmp_path, rows, dtype):
    # A torch._neg_view failed on the numpy path and was served un-negated through DLPack.
    _, served = _served_linear(tmp_path, *rows, dtype=dtype)
    x = torch.randn(4, 8).to(dtype)
    torch.testing.assert_close(served(torch._neg_view(x)), served(-x))
    torch.testing.assert_close(served(torch._neg_view(x.t().contiguous()).t()), served(-x))

