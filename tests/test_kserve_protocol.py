"""The KServe v2 protocol, batching and statistics without a server: no Ray, real onnxruntime.

Requests are encoded by tritonclient itself (``generate_request_body``) and responses decoded by it
(``parse_response_body``), so the tests hold the server to what a standard client sends and reads.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
import onnx
import pytest
import tritonclient.http as triton
from onnx import TensorProto, helper
from v2_requests import BAD_REQUESTS, INPUTS, MAX_ELEMENTS, OUTPUTS, ids_entry, json_body, x_entry

import clika_runtime as cr
from clika_runtime.base.errors import GraphInputError, ProtocolError, ServeError
from clika_runtime.base.specs import TensorInfo
from clika_runtime.kserve import batching, protocol, routes
from clika_runtime.kserve.stats import Statistics

MODEL = protocol.Model.from_graph("scorer", INPUTS, OUTPUTS)


def _parse(body: bytes, header_length: str | None = None) -> protocol.InferRequest:
    return protocol.parse_infer(MODEL, body, header_length, max_elements=MAX_ELEMENTS)


def _triton_inputs(x: np.ndarray, ids: np.ndarray, binary: bool) -> list[triton.InferInput]:
    inputs = [triton.InferInput("x", list(x.shape), "FP32"), triton.InferInput("ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(x, binary_data=binary)
    inputs[1].set_data_from_numpy(ids, binary_data=binary)
    return inputs


# --- requests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_requests_parse_to_the_arrays_sent(binary):
    x, ids = np.arange(12, dtype=np.float32).reshape(3, 4), np.array([7, 8, 9])
    outputs = [triton.InferRequestedOutput("best", binary_data=binary)]
    body, header_length = triton.InferenceServerClient.generate_request_body(
        _triton_inputs(x, ids, binary), outputs=outputs, request_id="r1"
    )
    request = _parse(body, None if header_length is None else str(header_length))
    assert list(request.inputs) == ["x", "ids"] and request.id == "r1"
    np.testing.assert_array_equal(request.inputs["x"], x)
    assert request.inputs["ids"].dtype == np.int64 and request.inputs["ids"].tolist() == [7, 8, 9]
    assert request.outputs == [("best", binary)]


def test_json_data_may_be_nested_and_inputs_in_any_order():
    nested = [[1, 2, 3, 4], [5, 6, 7, 8]]  # integers are fine for FP32
    request = _parse(json_body([ids_entry(), x_entry(data=nested)]))
    assert list(request.inputs) == ["x", "ids"]  # the graph's order
    assert request.inputs["x"].dtype == np.float32 and request.inputs["x"].tolist() == nested


def test_outputs_default_to_all_and_binary_output_applies_to_those_not_saying():
    assert _parse(json_body([x_entry(), ids_entry()])).outputs == [("scores", False), ("best", False)]
    everything_binary = json_body([x_entry(), ids_entry()], parameters={"binary_data_output": True})
    assert _parse(everything_binary).outputs == [("scores", True), ("best", True)]
    mixed = json_body([x_entry(), ids_entry()], parameters={"binary_data_output": True},
                      outputs=[{"name": "best", "parameters": {"binary_data": False}}, {"name": "scores"}])
    assert _parse(mixed).outputs == [("best", False), ("scores", True)]


def test_zero_rows_parse():
    request = _parse(json_body([x_entry(0), ids_entry(0)]))
    assert request.inputs["x"].shape == (0, 4) and request.inputs["ids"].shape == (0,)


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[b.id for b in BAD_REQUESTS])
def test_malformed_requests_are_refused_naming_the_input(bad):
    with pytest.raises(ProtocolError, match=bad.match) as caught:
        _parse(bad.body, bad.header_length)
    assert caught.value.status == bad.status


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("shape", [[0, 2**62], [2**62, 0], [0, 2**70]])
def test_a_tensor_of_no_elements_with_a_huge_size_is_refused(shape, binary):
    # numpy cannot make such an array ("array is too big"): it was a ValueError, answered 500
    model = protocol.Model.from_graph("m", [TensorInfo("x", "float32", ("n", "k"))], [TensorInfo("y", "float32", ("n", "k"))])
    entry = {"name": "x", "shape": shape, "datatype": "FP32"}
    entry.update({"parameters": {"binary_data_size": 0}} if binary else {"data": []})
    header = json.dumps({"inputs": [entry]}).encode()
    with pytest.raises(ProtocolError, match=rf"input 'x': shape \[{shape[0]}, {shape[1]}\] has a size over the server's limit of 1000"):
        protocol.parse_infer(model, header, str(len(header)) if binary else None, max_elements=1000)


def test_binary_bool_bytes_must_be_0_or_1():
    model = protocol.Model.from_graph("flags", [TensorInfo("m", "bool", ("n",))], [TensorInfo("m", "bool", ("n",))])
    header = json.dumps({"inputs": [{"name": "m", "shape": [2], "datatype": "BOOL",
                                     "parameters": {"binary_data_size": 2}}]}).encode()
    ok = protocol.parse_infer(model, header + b"\x00\x01", str(len(header)), max_elements=10)
    assert ok.inputs["m"].tolist() == [False, True]
    with pytest.raises(ProtocolError, match=r"input 'm': BOOL bytes must be 0 or 1"):
        protocol.parse_infer(model, header + b"\x00\x07", str(len(header)), max_elements=10)


# --- responses and metadata -------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_responses_decode_with_tritonclient(binary):
    request = protocol.InferRequest("r7", {}, [("best", binary), ("scores", binary)])
    scores = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    body, headers = protocol.encode_infer(MODEL, request, {"scores": scores, "best": np.array([2, 0])})
    header_length = headers.get(protocol.HEADER_LENGTH)
    assert (header_length is not None) == binary
    result = triton.InferenceServerClient.parse_response_body(
        body, header_length=None if header_length is None else int(header_length)
    )
    np.testing.assert_array_equal(result.as_numpy("scores"), scores)
    assert result.as_numpy("best").tolist() == [2, 0]
    response = result.get_response()
    assert response["model_name"] == "scorer" and response["id"] == "r7"
    assert [o["name"] for o in response["outputs"]] == ["best", "scores"]


def test_metadata_writes_dynamic_axes_as_minus_one():
    meta = protocol.model_metadata(MODEL)
    assert meta["name"] == "scorer" and meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "ids", "datatype": "INT64", "shape": [-1]}]
    assert meta["outputs"][0] == {"name": "scores", "datatype": "FP32", "shape": [-1, 3]}
    assert "binary_tensor_data" in protocol.server_metadata()["extensions"]


def test_graphs_the_protocol_cannot_carry_are_refused_at_startup():
    with pytest.raises(ServeError, match=r"graph output 'h' is bfloat16, which the v2 server cannot carry"):
        protocol.Model.from_graph("m", INPUTS, [TensorInfo("h", "bfloat16", ("n",))])
    with pytest.raises(ServeError, match=r"graph input 's' is tensor\(string\)"):
        protocol.Model.from_graph("m", [TensorInfo("s", "tensor(string)", ("n",))], OUTPUTS)
    with pytest.raises(ServeError, match=r"model name 'a/b': use letters"):
        protocol.Model.from_graph("a/b", INPUTS, OUTPUTS)


# --- routes and bodies ------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, endpoint", [
    ("GET", "/v2", "server"),
    ("GET", "/v2/health/live", "live"),
    ("GET", "/v2/health/ready", "ready"),
    ("GET", "/v2/models/scorer", "metadata"),
    ("GET", "/v2/models/scorer/versions/1", "metadata"),
    ("GET", "/v2/models/scorer/ready", "model_ready"),
    ("POST", "/v2/models/scorer/infer", "infer"),
    ("POST", "/v2/models/scorer/versions/1/infer", "infer"),
    ("GET", "/v2/models/scorer/stats", "stats"),
    ("GET", "/v2/models/stats", "stats"),
])
def test_routes(method, path, endpoint):
    assert routes.route(method, path, "scorer") == endpoint


@pytest.mark.parametrize("method, path, status, match", [
    ("POST", "/v2/models/other/infer", 404, r"unknown model 'other'; this server serves 'scorer'"),
    ("POST", "/v2/models/scorer/versions/2/infer", 404, r"model 'scorer' has version 1 only"),
    ("GET", "/v1/models/scorer:predict", 404, r"no endpoint at /v1/models/scorer:predict"),
    ("GET", "/v2/models/scorer/infer", 405, r"GET /v2/models/scorer/infer: this endpoint takes POST"),
    ("POST", "/v2/health/live", 405, r"takes GET"),
])
def test_unknown_routes_and_methods(method, path, status, match):
    with pytest.raises(ProtocolError, match=match) as caught:
        routes.route(method, path, "scorer")
    assert caught.value.status == status


async def _chunks(count: int, size: int, read: list[int]):
    for _ in range(count):
        read.append(size)
        yield b"x" * size


def test_body_over_the_cap_is_refused_from_content_length_before_reading():
    read: list[int] = []
    with pytest.raises(ProtocolError, match=r"request body of 5000 bytes is over the server's limit of 1000") as caught:
        asyncio.run(routes.read_body({"content-length": "5000"}, _chunks(5, 1000, read), 1000))
    assert caught.value.status == 413 and read == []


def test_body_over_the_cap_is_refused_while_streaming():
    read: list[int] = []
    with pytest.raises(ProtocolError, match=r"request body is over the server's limit of 1000 bytes") as caught:
        asyncio.run(routes.read_body({}, _chunks(100, 300, read), 1000))
    assert caught.value.status == 413 and len(read) == 4  # stopped at the first chunk past the cap
    assert asyncio.run(routes.read_body({"content-length": "600"}, _chunks(2, 300, []), 1000)) == b"x" * 600


@pytest.mark.parametrize("length", ["\u00b2", "9" * 5000, "-1", "1e9", " 12"])
def test_a_content_length_that_is_not_a_byte_count_is_refused(length):
    with pytest.raises(ProtocolError, match=r"Content-Length: expected a byte count, got ") as caught:
        asyncio.run(routes.read_body({"content-length": length}, _chunks(1, 10, []), 1000))
    assert caught.value.status == 400


async def _stalling(sent: bytes):
    yield sent
    await asyncio.sleep(60)  # a client that stopped sending
    yield b"never"


def test_a_body_that_stalls_is_refused_with_408_at_the_timeout():
    started = time.monotonic()
    with pytest.raises(ProtocolError, match=r"^request body not received within 0.2 s \(5 of 600 bytes arrived\)$") as caught:
        asyncio.run(routes.read_body({"content-length": "600"}, _stalling(b"x" * 5), 1000, timeout_s=0.2))
    assert caught.value.status == 408 and time.monotonic() - started < 5


def test_compressed_bodies_are_refused():
    with pytest.raises(ProtocolError, match=r"Content-Encoding 'gzip' is not supported"):
        asyncio.run(routes.read_body({"content-encoding": "gzip"}, _chunks(1, 10, []), 1000))


# --- batching on a real graph -----------------------------------------------------------------

@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """x float32 [n, k] -> doubled [n, k]; ids int64 [n] -> looked up [n, 2] in a table of 10 rows."""
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["doubled"]),
        helper.make_node("Gather", ["table", "ids"], ["looked_up"], axis=0),
    ]
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    model = helper.make_model(helper.make_graph(
        nodes, "doubler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "k"]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["n", "k"]),
         helper.make_tensor_value_info("looked_up", TensorProto.FLOAT, ["n", 2])],
        [onnx.numpy_helper.from_array(np.float32(2.0), "two"), onnx.numpy_helper.from_array(table, "table")],
    ), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path_factory.mktemp("kserve") / "doubler.onnx"
    onnx.save(model, str(path))
    return cr.load(path)


def _request(rows: int, k: int = 3, ids: list[int] | None = None) -> batching.Request:
    x = np.random.default_rng(rows * 10 + k).random((rows, k), dtype=np.float32)
    ids_array = np.array(ids if ids is not None else range(rows), dtype=np.int64)
    return batching.Request({"x": x, "ids": ids_array}, rows)


def test_served_graph_describes_and_runs_by_input_name(graph):
    assert graph.inputs == [TensorInfo("x", "float32", ("n", "k")), TensorInfo("ids", "int64", ("n",))]
    assert [o.shape for o in graph.outputs] == [("n", "k"), ("n", 2)]
    out = graph.run({"ids": np.array([3]), "x": np.ones((1, 2), np.float32)})
    assert list(out) == ["doubled", "looked_up"] and out["looked_up"].tolist() == [[6.0, 7.0]]
    with pytest.raises(GraphInputError, match=r"missing \['ids'\], unknown \['y'\]"):
        graph.run({"x": np.ones((1, 2), np.float32), "y": np.ones(1)})
    with pytest.raises(GraphInputError, match=r"input 'ids': expected dtype int64, got int32"):
        graph.run({"x": np.ones((1, 2), np.float32), "ids": np.ones(1, np.int32)})


def test_batch_dim_is_the_one_dynamic_dim_0_of_every_input_and_output(graph):
    model = protocol.Model.from_graph("doubler", graph.inputs, graph.outputs)
    assert batching.batch_dim(model)[0] == "n"
    assert batching.batch_dim(MODEL) == ("x_dim0", "batching on dim 'x_dim0' (axis 0 of every input and output)")


@pytest.mark.parametrize("inputs, outputs, reason", [
    ([TensorInfo("x", "float32", (4, "k"))], [TensorInfo("y", "float32", (4, "k"))],
     r"input 'x' has a static axis 0 \(size 4\)"),
    ([TensorInfo("x", "float32", ("n", 4)), TensorInfo("t", "float32", ())], [TensorInfo("y", "float32", ("n",))],
     r"input 't' is a scalar"),
    ([TensorInfo("x", "float32", ("n", 4))], [TensorInfo("y", "float32", ("m",))], r"axis 0 is not one dim"),
    ([TensorInfo("x", "float32", ("n", "n"))], [TensorInfo("y", "float32", ("n",))],
     r"input 'x' uses dim 'n' beyond axis 0"),
    ([TensorInfo("x", "float32", (None, 4))], [TensorInfo("y", "float32", (None,))], r"unnamed dynamic axis 0"),
])
def test_graphs_that_cannot_batch_say_why(inputs, outputs, reason):
    dim, why = batching.batch_dim(protocol.Model.from_graph("m", inputs, outputs))
    assert dim is None and why.startswith("cannot batch: ") and why.endswith("requests run one by one")
    assert re.search(reason, why), why


def test_the_plan_says_whether_requests_share_runs():
    assert batching.plan(MODEL, 8, 5.0) == batching.Plan(
        "x_dim0", True, 8, "batching on dim 'x_dim0' (axis 0 of every input and output), up to 8 rows per run, "
        "waiting at most 5 ms")
    assert batching.plan(MODEL, 1, 5.0) == batching.Plan(
        "x_dim0", False, 1, "not batching: at most 1 row per run; the graph could batch on dim 'x_dim0'")
    static = protocol.Model.from_graph("m", [TensorInfo("x", "float32", (4,))], [TensorInfo("y", "float32", (4,))])
    assert batching.plan(static, 8, 5.0) == batching.Plan(
        None, False, 0, "cannot batch: input 'x' has a static axis 0 (size 4); requests run one by one")


def test_the_plan_stays_within_the_batch_dims_range():
    capped = batching.plan(MODEL, 32, 5.0, ranges=[("other", 0, 2), ("x_dim0", 1, 16)])
    assert (capped.stacks, capped.max_rows) == (True, 16)
    assert "up to 16 rows per run (the graph's range for dim 'x_dim0' ends at 16)" in capped.sentence
    assert batching.plan(MODEL, 8, 5.0, ranges=[("x_dim0", 0, None)]).max_rows == 8
    assert batching.plan(MODEL, 8, 5.0, ranges=[("x_dim0", 1, 1)]).stacks is False


def test_requests_are_stacked_by_shape_group_and_split_back_in_order(graph):
    requests = [_request(1), _request(2, k=5), _request(3), _request(1, k=5), _request(2)]
    outcomes, executions = batching.run_batch(graph.run, requests)
    assert sorted(e.rows for e in executions) == [3, 6]  # k=5: 2 + 1 rows; k=3: 1 + 3 + 2 rows
    for request, outcome in zip(requests, outcomes):
        alone = graph.run(request.feeds)
        assert list(outcome) == ["doubled", "looked_up"]
        for name in alone:
            np.testing.assert_array_equal(outcome[name], alone[name])


def test_a_request_that_breaks_the_graph_fails_alone(graph):
    requests = [_request(2), _request(1, ids=[42]), _request(3)]  # id 42: out of the table's 10 rows
    outcomes, executions = batching.run_batch(graph.run, requests)
    assert isinstance(outcomes[1], Exception) and "out of data bounds" in str(outcomes[1])
    np.testing.assert_array_equal(outcomes[0]["doubled"], requests[0].feeds["x"] * 2)
    np.testing.assert_array_equal(outcomes[2]["looked_up"], graph.run(requests[2].feeds)["looked_up"])
    assert [e.rows for e in executions] == [2, 3]  # the failed stacked run is not counted


def test_rows_count_at_least_one_per_request():
    assert batching.rows_of([_request(3), batching.Request({}, 0)]) == 4


# --- statistics -------------------------------------------------------------------------------

def test_statistics_in_tritons_shape():
    stats = Statistics()
    stats.queued(1_000)
    stats.executed(rows=4, ns=50_000)
    stats.answered(True, 70_000, inferences=4)
    stats.answered(False, 5_000, inferences=0)
    model = stats.as_json("scorer")["model_stats"][0]
    assert model["name"] == "scorer" and model["version"] == "1" and model["last_inference"] > 0
    assert (model["inference_count"], model["execution_count"]) == (4, 1)
    assert model["inference_stats"]["success"] == {"count": 1, "ns": 70_000}
    assert model["inference_stats"]["fail"] == {"count": 1, "ns": 5_000}
    assert model["inference_stats"]["compute_infer"] == {"count": 1, "ns": 50_000}
    assert model["batch_stats"] == [{"batch_size": 4, "compute_infer": {"count": 1, "ns": 50_000}}]
