"""Triton model repositories: ModelGraph.to_triton, check_repository and `clika-runtime triton`.

Every written config is parsed with Triton's own schema (tritonclient's model_config_pb2) and
compared with the graph it came from; every refusal is matched by its message. Real captures, real
onnxruntime. No Triton server runs here: what Triton checks when it loads a model is checked from its
schema and from the graph, by rules written down (with their sources) in clika_runtime/triton/rules.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import TinyNet
from google.protobuf import text_format
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2

import clika_runtime as cr
from clika_runtime.cli import main as cli
from clika_runtime.triton import pbtxt
from clika_runtime.triton.checker import check_repository, read_config


class Multi(torch.nn.Module):
    """Several inputs, two of them int64, and a [batch] input and output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids, pos, scale):
        return {"h": self.embed(ids) * scale[:, None, None] + pos[..., None], "n": ids.sum(1)}


def _capture(target, *calls, **options) -> cr.ModelGraph:
    f = cr.compile(target, **options)
    with torch.no_grad():
        for args in calls:
            f(*args)
    return f.take_graph()


def _ids(batch: int) -> tuple:
    return torch.randint(0, 10, (batch, 3)), torch.arange(3).expand(batch, 3).clone(), torch.rand(batch)


@pytest.fixture(scope="module")
def batched():
    """TinyNet with batch drift: x [x_dim0, 8] -> output [x_dim0, 8]."""
    return _capture(TinyNet().eval(), (torch.randn(2, 8),), (torch.randn(4, 8),))


@pytest.fixture(scope="module")
def masked():
    """Two inputs that share the batch dim."""
    return _capture(TinyNet().eval(), (torch.randn(2, 5, 8), torch.ones(2, 5)), (torch.randn(3, 5, 8), torch.ones(3, 5)))


@pytest.fixture(scope="module")
def multi():
    return _capture(Multi().eval(), _ids(2), _ids(5))


@pytest.fixture(scope="module")
def static():
    # dynamic=False: the same TinyNet captured at two batch sizes elsewhere teaches the disk cache
    # that its dim 0 drifts, and a later first capture would be planned dynamic.
    return _capture(TinyNet().eval(), (torch.randn(2, 8),), dynamic=False)


@pytest.fixture(scope="module")
def lifted():
    """A rank-0 input (the lifted number k), a rank-0 output, and an output whose dim 0 is min(k, x_dim0)."""
    return _capture(lambda x, k: (x[:k] * 2, k), (torch.randn(5, 3), 2), (torch.randn(6, 3), 3), specialize=False)


@pytest.fixture(scope="module")
def bf16():
    return _capture(lambda x: (x * 2).bfloat16(), (torch.randn(2, 3),), (torch.randn(4, 3),))


# Independent of the library's table: ONNX element type name -> Triton data type.
TRITON = {"FLOAT": "TYPE_FP32", "INT64": "TYPE_INT64", "BFLOAT16": "TYPE_BF16"}


def _parse(folder: Path):
    return text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def _kind(group) -> str:
    return model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)


def _assert_agrees(config, graph: cr.ModelGraph, batch: int) -> None:
    """Names in order, data types and dims of every entry, against the graph's own inputs and outputs."""
    proto = graph.model_proto.graph
    initializers = {i.name for i in proto.initializer}
    values = {"input": [v for v in proto.input if v.name not in initializers], "output": list(proto.output)}
    batch_dims = set()
    for role, entries in (("input", config.input), ("output", config.output)):
        assert [e.name for e in entries] == [v.name for v in values[role]]
        for entry, value in zip(entries, values[role]):
            onnx_type = TensorProto.DataType.Name(value.type.tensor_type.elem_type)
            assert model_config_pb2.DataType.Name(entry.data_type) == TRITON[onnx_type], entry.name
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
            if batch:
                assert dims[0] == -1, entry.name
                batch_dims.add(value.type.tensor_type.shape.dim[0].dim_param)
                dims = dims[1:]
            assert list(entry.dims) == (dims or [1]), entry.name
            # A batched [batch] tensor is dims [1] reshaped to []; a rank-0 one without batching is dims [1].
            assert entry.HasField("reshape") == (not dims and batch > 0), entry.name
            assert list(entry.reshape.shape) == []
    assert len(batch_dims) <= 1, f"dim 0s differ: {batch_dims}"


CASES = {  # fixture, options, the model name expected
    "batched, dynamic batching": ("batched", {"max_batch_size": 8, "dynamic_batching": True}, "TinyNet"),
    "batched, no batching": ("batched", {}, "TinyNet"),
    "two inputs, gpu instances": ("masked", {"max_batch_size": 4, "instances": 2, "kind": "gpu", "dynamic_batching": {
        "preferred_batch_size": [2, 4], "max_queue_delay_microseconds": 500}}, "TinyNet"),
    "int64 inputs, [batch] tensors": ("multi", {"max_batch_size": 16}, "Multi"),
    "static": ("static", {"version": 3}, "TinyNet"),
    "lifted number": ("lifted", {"name": "lifted"}, "lifted"),
    "bfloat16": ("bf16", {"max_batch_size": 2}, "lambda"),  # graph 'bf16.<locals>.<lambda>'
}


@pytest.mark.parametrize("case", CASES)
def test_written_config_parses_with_tritons_schema_and_agrees_with_the_graph(case, request, tmp_path):
    fixture, options, name = CASES[case]
    graph = request.getfixturevalue(fixture)
    folder = graph.to_triton(tmp_path, **options)
    config = _parse(folder)
    assert folder == tmp_path / name and config.name == name
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == options.get("max_batch_size", 0)
    _assert_agrees(config, graph, config.max_batch_size)
    kind = f"KIND_{options.get('kind', 'cpu').upper()}"
    assert [(g.count, _kind(g)) for g in config.instance_group] == [(options.get("instances", 1), kind)]
    batching = options.get("dynamic_batching")
    assert config.HasField("dynamic_batching") == bool(batching)
    if isinstance(batching, dict):
        assert list(config.dynamic_batching.preferred_batch_size) == batching["preferred_batch_size"]
        assert config.dynamic_batching.max_queue_delay_microseconds == batching["max_queue_delay_microseconds"]
    version = options.get("version", 1)
    model = folder / str(version) / "model.onnx"
    assert cr.ModelGraph.load(model).input_names == graph.input_names
    assert check_repository(folder) == []


def test_the_config_reads_as_tritons_docs_write_them(batched, tmp_path):
    folder = batched.to_triton(tmp_path, "tiny", max_batch_size=8,
                               dynamic_batching={"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": 100})
    assert (folder / "config.pbtxt").read_text() == textwrap.dedent(f"""\
        # Written by clika_runtime {cr.__version__} from graph 'TinyNet'; check: clika-runtime validate <this folder>
        name: "tiny"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [
          {{
            name: "x"
            data_type: TYPE_FP32
            dims: [ 8 ]
          }}
        ]
        output [
          {{
            name: "output"
            data_type: TYPE_FP32
            dims: [ 8 ]
          }}
        ]
        dynamic_batching {{
          preferred_batch_size: [ 4, 8 ]
          max_queue_delay_microseconds: 100
        }}
        instance_group [
          {{
            count: 1
            kind: KIND_CPU
          }}
        ]
        """)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "tiny", "tiny/1", "tiny/1/model.onnx", "tiny/config.pbtxt"]


def test_bfloat16_is_written_with_a_warning_about_older_tritons(bf16, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="clika_runtime"):
        bf16.to_triton(tmp_path, "b")
    assert "from release 26.03 on; older releases refuse the model" in caplog.text


# ------------------------------------------------------------------------------------------ refusals


def _complex_graph() -> cr.ModelGraph:
    z = helper.make_tensor_value_info("z", TensorProto.COMPLEX64, ["n"])
    out = helper.make_tensor_value_info("out", TensorProto.COMPLEX64, ["n"])
    graph = helper.make_graph([helper.make_node("Identity", ["z"], ["out"])], "spectrum", [z], [out])
    return cr.ModelGraph(helper.make_model(graph))


def _external_reference(graph: cr.ModelGraph, location: str) -> cr.ModelGraph:
    """The graph with its first initializer's weights left in a file at ``location``."""
    proto = onnx.ModelProto()
    proto.CopyFrom(graph.model_proto)
    weight = proto.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=location)
    return cr.ModelGraph(proto)


REFUSALS = {  # graph, options, the message (a regular expression)
    "static dim 0": (
        "static", {"max_batch_size": 4},
        r"^max_batch_size > 0 but input 'x' has a static dim 0 \[2, 8\]: make it dynamic when capturing, with "
        r"dynamic_axes=\{'x': \{0: 'batch'\}\}, a signature TensorSpec\(\('batch', \.\.\.\)\), or a call at a "
        r"second batch size before take_graph\(\); max_batch_size > 0 but output 'output' has a static dim 0"),
    "lifted number": (
        "lifted", {"max_batch_size": 4},
        r"input 'k' is rank 0 \(a lifted Python number\), which cannot be batched along dim 0: use max_batch_size=0"),
    "output dim 0 not the batch": (
        "lifted", {"max_batch_size": 4},
        r"output 'out_0' has dim 0 'Min\(\w+, x_dim0\)', not the batch dim 'x_dim0' of input 'x': "
        r"Triton would split it as if it were"),
    "inputs with two batch dims": (
        "two_batches", {"max_batch_size": 4},
        r"input 'b' has dim 0 'b_dim0', not the batch dim 'a_dim0' of input 'a': declare them one dim, with equal "
        r"names in signature or dynamic_axes \(e\.g\. \{'a': \{0: 'batch'\}, 'b': \{0: 'batch'\}\}\)"),
    "output reduced over the batch": (
        "reduced", {"max_batch_size": 4},
        r"output 'output' has a static dim 0 \[3\]: Triton splits every output along its dim 0"),
    "batch dim past dim 0": (
        "gram", {"max_batch_size": 4},
        r"output 'output' \[x_dim0, x_dim0\] uses the batch dim 'x_dim0' past dim 0: requests batched together "
        r"would see each other's rows; use max_batch_size=0"),
    "max batch past the guard": (
        "branch", {"max_batch_size": 32},
        r"^max_batch_size 32 is past the sizes the graph takes for its batch dim 'x_dim0' \(up to 4: .*\): "
        r"use max_batch_size=4$"),
    "batch sizes below the guard": (  # traced at batches 5 and 8: the guard starts at 5, Triton sends 1..8
        "branch_high", {"max_batch_size": 8},
        r"^max_batch_size 8: Triton sends batches of 1 to 8, but the graph takes sizes from 5 on for its batch dim "
        r"'x_dim0' \(it was traced for those; Triton does not check; its trace branched on the batch size\): use "
        r"max_batch_size=0 and send batches of 5 or more, or take the branch out of the model$"),
    "complex dtype": (
        "complex", {},
        r"input 'z' is complex64, which Triton's onnxruntime backend does not take \(it takes "
        r"TYPE_BOOL, .*TYPE_BF16, .*\): cast it in the model"),
    "name ..": ("batched", {"name": ".."}, r"model name '\.\.': Triton needs one directory name \(no '/', not '\.'"),
    "name with /": ("batched", {"name": "a/b"}, r"model name 'a/b': Triton needs one directory name .* e\.g\. 'a_b'"),
    "blank name": ("batched", {"name": "  "}, r"model name '  ': Triton refuses an empty or all-space name"),
    "absolute external data": ("abs_data", {}, r"external data location '/etc/passwd' is absolute or climbs out"),
    "external data climbing out": (
        "up_data", {},
        r"location '\.\./\.\./secret\.bin' is absolute or climbs out of the model's folder \('\.\.'\): refused, "
        r"it would read a file outside the repository"),
    "windows drive": ("drive_data", {}, r"location 'C:\\\\w\.bin' is absolute or climbs out"),
    "external data not loaded": (
        "unloaded", {},
        r"weights left in the external file 'w\.bin', not in the graph: load the graph with ModelGraph\.load\(path\)"),
    "dynamic batching off": ("batched", {"dynamic_batching": True}, r"^dynamic_batching needs max_batch_size > 0"),
    "preferred size past the max": (
        "batched", {"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [8]}},
        r"^dynamic_batching preferred_batch_size 8 is past max_batch_size 4$"),
    "preferred size not a list": (
        "batched", {"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": 4}},
        r"^dynamic_batching preferred_batch_size: expected a list of ints, got 4$"),
    "unknown batching key": (
        "batched", {"max_batch_size": 4, "dynamic_batching": {"max_delay": 5}},
        r"unknown key\(s\) \['max_delay'\]; expected some of \['preferred_batch_size', 'max_queue_delay_microseconds'\]"),
    "version 0": ("batched", {"version": 0}, r"^version: expected an int >= 1, got 0$"),
    "no instances": ("batched", {"instances": 0}, r"^instances: expected an int >= 1, got 0$"),
    "negative batch": ("batched", {"max_batch_size": -1}, r"^max_batch_size: expected an int >= 0, got -1$"),
    "bool batch": ("batched", {"max_batch_size": True}, r"^max_batch_size: expected an int >= 0, got True$"),
    "kind": ("batched", {"kind": "tpu"}, r"^kind: expected 'cpu' or 'gpu', got 'tpu'$"),
    "name with a newline": ("batched", {"name": "a\nb"}, r"^model name 'a\\nb': control characters .* e\.g\. 'a_b'$"),
    "batching as a word": ("batched", {"max_batch_size": 4, "dynamic_batching": "yes"},
                           r"^dynamic_batching: expected True or a dict with some of \['preferred_batch_size', "
                           r"'max_queue_delay_microseconds'\], got 'yes'$"),
    "batch condition": ("even", {"max_batch_size": 8}, r"traced under a condition on its batch dim 'x_dim0' "
                        r"\(x\.shape\[0\] % 2 == 0\): requests batched together would change it; use max_batch_size=0"),
}


@pytest.fixture(scope="module")
def refused(batched, static, lifted):
    """The graphs the refusals are made from, by name; captured ones only when asked for."""
    built = {"batched": batched, "static": static, "lifted": lifted, "complex": _complex_graph()}
    built.update({name: _external_reference(batched, location) for name, location in (
        ("abs_data", "/etc/passwd"), ("up_data", "../../secret.bin"), ("drive_data", "C:\\w.bin"), ("unloaded", "w.bin"))})

    def get(name: str) -> cr.ModelGraph:
        if name == "two_batches":
            return _capture(lambda a, b: (a * 2, b + 1), (torch.randn(2, 3), torch.randn(3, 2)), dynamic=True)
        if name == "reduced":
            return _capture(lambda x: x.sum(0), (torch.randn(2, 3),), (torch.randn(4, 3),))
        if name == "gram":
            return _capture(lambda x: x @ x.T, (torch.randn(2, 4),), (torch.randn(3, 4),))
        if name == "branch":  # traced at batches 2 and 3: the guard ends at 4
            return _capture(lambda x: x * 2 if x.shape[0] > 4 else x + 1, (torch.randn(2, 4),), (torch.randn(3, 4),))
        if name == "even":  # a size condition on the batch dim: batching requests together flips it
            return _capture(lambda x: x * 2 if x.shape[0] % 2 == 0 else x * 3, (torch.randn(2, 4),), (torch.randn(4, 4),))
        if name == "branch_high":  # the other side of the branch: the guard starts at 5
            return _capture(lambda x: x * 2 if x.shape[0] > 4 else x * 3, (torch.randn(5, 4),), (torch.randn(8, 4),))
        return built[name]

    return get


@pytest.mark.parametrize("case", REFUSALS)
def test_what_triton_would_refuse_is_refused_before_anything_is_written(case, refused, tmp_path):
    source, options, message = REFUSALS[case]
    with pytest.raises(cr.DeployError, match=message) as caught:
        refused(source).to_triton(tmp_path / "repo", **options)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)
    assert not (tmp_path / "repo").exists()


# ------------------------------------------------------------------------------ the guard in the model


class _Width(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[1] % 4 == 0 else x * 3


@pytest.fixture(scope="module")
def widths():
    """Traced at widths 8 and 12: the guard holds the graph to widths divisible by 4."""
    return _capture(_Width().eval(), (torch.randn(2, 8),), (torch.randn(3, 12),), dynamic=True)


def _run(folder: Path, **feeds) -> list:
    session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {k: np.asarray(v) for k, v in feeds.items()})


def test_trap_a_size_branch_on_a_non_batch_dim_is_enforced_in_the_model_triton_serves(widths, tmp_path):
    # Triton sends any width (dims -1) and reads no guard: the written model served width 10 the
    # `% 4 == 0` side, x * 2 where eager gives x * 3, and check_repository found nothing.
    folder = widths.to_triton(tmp_path / "repo", max_batch_size=8, dynamic_batching=True)
    for shape in ((2, 8), (5, 12), (1, 4)):
        x = np.random.rand(*shape).astype(np.float32)
        np.testing.assert_allclose(_run(folder, x=x)[0], x * 2, rtol=1e-6)
    with pytest.raises(Exception, match=r"clika_runtime\.guard: the request's sizes are outside what the graph was "
                                        r"traced for \(x\.shape\[1\] % 4 == 0; every dynamic size >= 1\)"):
        _run(folder, x=np.ones((2, 10), np.float32))
    with pytest.raises(Exception, match=r"clika_runtime\.guard: "):  # size 0: assumed away by the trace
        _run(folder, x=np.ones((0, 8), np.float32))
    assert check_repository(folder) == []


def test_dims_the_graph_shares_are_held_equal_in_the_model_triton_serves(masked, tmp_path):
    folder = masked.to_triton(tmp_path / "repo", max_batch_size=4)
    _run(folder, x=np.ones((3, 5, 8), np.float32), mask=np.ones((3, 5), np.float32))
    with pytest.raises(Exception, match=r"clika_runtime\.guard: .*x\.shape\[0\] == mask\.shape\[0\]"):
        _run(folder, x=np.ones((3, 5, 8), np.float32), mask=np.ones((2, 5), np.float32))


def test_trap_check_repository_of_a_repository_names_its_models(widths, tmp_path):
    # It read "[Errno 2] No such file or directory: '<repo>/config.pbtxt'".
    widths.to_triton(tmp_path / "repo", name="a")
    widths.to_triton(tmp_path / "repo", name="b")
    assert check_repository(tmp_path / "repo") == [
        f"{tmp_path / 'repo'}: a model repository, not a model folder: check one of its models (a, b)"]
    assert check_repository(tmp_path / "none") == [
        f"{tmp_path / 'none'}: no such folder (expected a Triton model folder, holding config.pbtxt)"]


def test_check_repository_flags_a_model_without_its_guard(widths, tmp_path):
    folder = widths.to_triton(tmp_path / "repo")
    widths.save(folder / "1" / "model.onnx")  # the graph as captured, over the written one
    (problem,) = check_repository(folder)
    assert problem.startswith("the graph's guard is not in the model (x.shape[1] % 4 == 0; every dynamic size >= 1): "
                              "Triton does not check it"), problem


# ------------------------------------------------------------------------------------- external data


def test_external_data_goes_in_the_multi_file_layout_and_serves(batched, tmp_path):
    folder = batched.to_triton(tmp_path, "ext", max_batch_size=8, external_data=True)
    inner = folder / "1" / "model.onnx" / "model.onnx"
    assert inner.is_file() and len(list(inner.parent.glob("model.onnx.*.data"))) == 1  # named by content
    assert check_repository(folder) == []
    session = ort.InferenceSession(str(inner), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    served = cr.load(inner)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], served(x), rtol=1e-6)
    assert cli(["validate", str(folder)]) == 0
    # Writing the version again as one file replaces the folder.
    batched.to_triton(tmp_path, "ext", max_batch_size=8)
    assert (folder / "1" / "model.onnx").is_file() and check_repository(folder) == []


# ------------------------------------------------------------------------------ checking a repository


def _edit_config(old: str, new: str):
    def edit(folder: Path) -> None:
        path = folder / "config.pbtxt"
        text = path.read_text()
        assert old in text, old
        path.write_text(text.replace(old, new, 1))
    return edit


def _edit_location(location: str, target: str | None = None):
    """Point the stored model's external data at ``location`` (a link to ``target`` when given)."""
    def edit(folder: Path) -> None:
        model = folder / "1" / "model.onnx" / "model.onnx"
        proto = onnx.load_model(str(model), load_external_data=False)
        for tensor in proto.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save_model(proto, str(model))
        if target is not None:
            (data,) = model.parent.glob("model.onnx.*.data")
            Path(target).write_bytes(data.read_bytes())
            os.symlink(target, model.parent / location)
    return edit


def _rename(folder: Path) -> None:
    folder.rename(folder.with_name("renamed"))


TAMPERED = {
    "data type": (_edit_config("data_type: TYPE_FP32", "data_type: TYPE_INT64"),
                  "input 'x': config data_type TYPE_INT64, the graph's is TYPE_FP32"),
    "input dims": (_edit_config("dims: [ 8 ]", "dims: [ 16 ]"),
                   "input 'x': config shape [-1] + [16] does not fit the graph's [-1, 8]"),
    "output dims loosened": (_edit_config("dims: [ 8 ]\n  }\n]\ndyn", "dims: [ -1 ]\n  }\n]\ndyn"),
                             "output 'output': config shape [-1] + [-1] does not fit the graph's [-1, 8]"),
    "zero dim": (_edit_config("dims: [ 8 ]", "dims: [ 0 ]"),
                 "input 'x': config dims [0]: Triton requires one or more dims, each >= 1 or -1"),
    "unknown input": (_edit_config('name: "x"', 'name: "y"'),
                      "config input 'y' is not a graph input; the graph's are ['x']"),
    "name differs from the folder": (
        _rename, "config name 'tiny' differs from its folder's name 'renamed': Triton requires them equal"),
    "platform": (_edit_config('platform: "onnxruntime_onnx"', 'platform: "tensorrt_plan"'),
                 "config platform 'tensorrt_plan', backend '': expected platform 'onnxruntime_onnx' for an ONNX model"),
    "preferred size": (_edit_config("preferred_batch_size: [ 4, 8 ]", "preferred_batch_size: [ 4, 16 ]"),
                       "dynamic_batching preferred_batch_size 16: Triton requires 1..max_batch_size (8)"),
    "no version": (lambda folder: shutil.rmtree(folder / "1"), "no version folder (a positive integer name)"),
    "external data climbing out": (
        _edit_location("../../secret.bin"),
        "external data location '../../secret.bin' is absolute or climbs out of the model's folder"),
    "external data missing": (_edit_location("gone.bin"), "external data location 'gone.bin' names no file in"),
    "model file outside the folder": (
        _edit_config('platform: "onnxruntime_onnx"', 'platform: "onnxruntime_onnx"\ndefault_model_filename: "../../x.onnx"'),
        "default_model_filename '../../x.onnx' is absolute or climbs out of the version folder ('..')"),
}


@pytest.fixture
def tiny_folder(batched, tmp_path):
    return batched.to_triton(tmp_path / "repo", "tiny", max_batch_size=8, external_data=True,
                             dynamic_batching={"preferred_batch_size": [4, 8]})


@pytest.mark.parametrize("case", TAMPERED)
def test_check_repository_names_what_triton_would_refuse(case, tiny_folder):
    edit, message = TAMPERED[case]
    edit(tiny_folder)
    folder = tiny_folder if tiny_folder.exists() else tiny_folder.with_name("renamed")
    problems = check_repository(folder)
    assert any(message in p for p in problems), problems


def test_check_repository_refuses_data_that_links_out_and_configs_outside_the_schema(batched, tiny_folder, tmp_path):
    _edit_location("link.bin", target=str(tmp_path / "outside.bin"))(tiny_folder)
    problems = check_repository(tiny_folder)
    assert len(problems) == len(batched.model_proto.graph.initializer) == 2  # weight and bias
    assert all(p.endswith("external data location 'link.bin' links out of the model's folder") for p in problems), problems
    _edit_config("max_batch_size: 8", "max_batch_size: 8\nmax_batch: 3")(tiny_folder)
    (problem,) = check_repository(tiny_folder)
    assert "config.pbtxt: not a Triton model config" in problem and "max_batch" in problem


def test_check_repository_applies_the_batching_rule_to_a_hand_edited_config(static, tmp_path):
    folder = static.to_triton(tmp_path, "s")
    _edit_config("max_batch_size: 0", "max_batch_size: 2")(folder)
    problems = check_repository(folder)
    assert any(p.startswith("max_batch_size > 0 but input 'x' has a static dim 0 [2, 8]") for p in problems), problems


def test_check_repository_flags_a_hand_edited_max_batch_past_the_guard(refused, tmp_path):
    folder = refused("branch").to_triton(tmp_path, "b", max_batch_size=4)
    assert check_repository(folder) == []
    _edit_config("max_batch_size: 4", "max_batch_size: 16")(folder)
    assert check_repository(folder) == [
        "max_batch_size 16 is past the sizes the graph takes for its batch dim 'x_dim0' (up to 4: it was traced "
        "for those; Triton does not check): use max_batch_size=4"]


def test_check_repository_flags_a_batching_config_over_a_graph_that_starts_past_batch_1(refused, tmp_path):
    folder = refused("branch_high").to_triton(tmp_path, "b", max_batch_size=0)
    assert check_repository(folder) == []
    config = folder / "config.pbtxt"
    text = config.read_text()
    assert text.count("dims: [ -1, 4 ]") == 2, text
    config.write_text(text.replace("max_batch_size: 0", "max_batch_size: 8").replace("dims: [ -1, 4 ]", "dims: [ 4 ]"))
    problems = check_repository(folder)
    assert problems and problems[0].startswith(
        "max_batch_size 8: Triton sends batches of 1 to 8, but the graph takes sizes from 5 on"), problems


def test_without_tritonclient_the_own_reader_gives_the_same_answers(request, tmp_path):
    """The fallback reader (no tritonclient: a plain deployment box) against Triton's schema."""
    folders = []
    for case, (fixture, options, _) in CASES.items():
        folders.append(request.getfixturevalue(fixture).to_triton(tmp_path / case.replace(" ", "_"), **options))
    bad = request.getfixturevalue("batched").to_triton(tmp_path / "bad", max_batch_size=4)
    _edit_config("dims: [ 8 ]", "dims: [ 16 ]")(bad)
    folders.append(bad)
    script = textwrap.dedent("""
        import json, sys
        sys.modules["tritonclient"] = None  # any import of it now fails
        from clika_runtime.triton.checker import check_repository, read_config
        print(json.dumps([[repr(read_config(f + "/config.pbtxt")), check_repository(f)] for f in sys.argv[1:]]))
    """)
    result = subprocess.run([sys.executable, "-c", script, *map(str, folders)], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    expected = [[repr(read_config(f / "config.pbtxt")), check_repository(f)] for f in folders]
    assert json.loads(result.stdout) == expected
    assert expected[-1][1] == ["input 'x': config shape [-1] + [16] does not fit the graph's [-1, 8]"]


def test_the_own_reader_takes_the_forms_people_write_by_hand():
    tree = pbtxt.parse(textwrap.dedent("""\
        # a comment
        name: "m\\"q"  platform: 'onnxruntime_onnx'
        input { name: "x" data_type: TYPE_FP32 dims: 1 dims: -1 }
        input < name: "y", dims: [ 2 ] >;
        parameters { key: "k" value: { string_value: "v" } }
        optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" } ] } }
        """))
    assert tree["name"] == ['m"q'] and tree["platform"] == ["onnxruntime_onnx"]
    assert tree["input"] == [{"name": ["x"], "data_type": ["TYPE_FP32"], "dims": [1, -1]}, {"name": ["y"], "dims": [2]}]
    assert tree["optimization"][0]["execution_accelerators"][0]["gpu_execution_accelerator"] == [{"name": ["tensorrt"]}]
    with pytest.raises(ValueError, match=r"^line 2: expected a value, got '\]'"):
        pbtxt.parse('name: "m"\ndims: ]')


# ----------------------------------------------------------------------------------------------- CLI


def test_cli_triton_writes_and_validate_checks_the_folder(batched, static, tmp_path, capsys):
    model, repository = batched.save(tmp_path / "tiny.onnx"), tmp_path / "repo"
    assert cli(["triton", str(model), "--repository", str(repository), "--max-batch-size", "8",
                "--dynamic-batching", "--instances", "2", "--gpu"]) == 0
    folder = repository / "TinyNet"
    assert capsys.readouterr().out == (f"wrote {folder} (version 1); serve it with: "
                                       f"tritonserver --model-repository {repository}\n")
    config = _parse(folder)
    assert config.max_batch_size == 8 and config.HasField("dynamic_batching")
    assert [(g.count, _kind(g)) for g in config.instance_group] == [(2, "KIND_GPU")]
    assert cli(["validate", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "triton model folder" in out and "ok" in out and "runs at x_dim0=8" in out
    _edit_config("dims: [ 8 ]", "dims: [ 16 ]")(folder)
    assert cli(["validate", str(folder)]) == 1
    assert "input 'x': config shape [-1] + [16] does not fit the graph's [-1, 8]" in capsys.readouterr().out


@pytest.mark.parametrize("arguments, message", [
    (["--max-batch-size", "4"], "error: max_batch_size > 0 but input 'x' has a static dim 0 [2, 8]: make it dynamic"),
    (["--dynamic-batching"], "error: dynamic_batching needs max_batch_size > 0"),
    (["--name", "a/b"], "error: model name 'a/b': Triton needs one directory name"),
    (["--instances", "0"], "error: instances: expected an int >= 1, got 0"),
])
def test_cli_triton_usage_errors_exit_2_with_one_line(static, tmp_path, capsys, arguments, message):
    model = static.save(tmp_path / "static.onnx")
    assert cli(["triton", str(model), "--repository", str(tmp_path / "repo"), *arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "repo").exists()


def test_cli_triton_missing_model_exits_2(tmp_path, capsys):
    assert cli(["triton", str(tmp_path / "missing.onnx"), "--repository", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.onnx'}: no such file\n"
