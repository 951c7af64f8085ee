"""The KServe v2 server for real: Ray Serve on 127.0.0.1, a standard client, no mocks.

One Ray instance for the module (started in-process, shut down at the end, its processes checked
gone), plus one ``clika-runtime serve`` run in a subprocess for the command itself.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import psutil
import pytest
import ray
import torch
import tritonclient.http as triton
from ray import serve
from tritonclient.utils import InferenceServerException

import clika_runtime as cr
from clika_runtime import kserve
from v2_requests import BAD_REQUESTS, ids_entry, json_body, x_entry

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


class Scorer(torch.nn.Module):
    """Two inputs and two outputs sharing a dynamic batch dim; an id past the table breaks the graph.

    Traced at small batches, the graph holds the first branch only: its shipped guard says the
    batch dim ends at 16.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.embed = torch.nn.Embedding(10, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        scores = torch.tanh(self.proj(x)) + self.embed(ids)
        if x.shape[0] > 16:
            scores = scores.clamp(-0.5, 0.5)
        return {"scores": scores, "best": scores.argmax(-1)}


class Server(NamedTuple):
    model: Scorer
    url: str  # host:port, as tritonclient takes it
    plan: str  # what the replica says of its batching

    def eager(self, x: np.ndarray, ids: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {k: v.numpy() for k, v in self.model(torch.from_numpy(x), torch.from_numpy(ids)).items()}

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        connection = http.client.HTTPConnection(self.url, timeout=30)
        try:
            connection.request("POST", path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            connection.close()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    torch.manual_seed(0)
    model = Scorer().eval()
    f = cr.compile(model)
    with torch.no_grad():
        f(torch.randn(2, 4), torch.randint(0, 10, (2,)))
        f(torch.randn(5, 4), torch.randint(0, 10, (5,)))  # the batch dim becomes dynamic
    path = f.take_graph().save(tmp_path_factory.mktemp("kserve") / "scorer.onnx")
    return model, path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(processes: list[psutil.Process], timeout: float = 30.0) -> list[str]:
    """Names of the processes still alive after ``timeout``."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return [f"{p.pid} {p.name()}" for p in alive if p.is_running()]


@pytest.fixture(scope="module")
def server(shipped):
    model, path = shipped
    port = _free_port()
    # A Ray of its own (never one started on this machine with `ray start`); replica logs stay in
    # Ray's log files instead of interleaving with pytest's output.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        application = kserve.app(path, name="scorer", max_batch_size=32, batch_wait_ms=50, max_request_mb=1)
        handle = serve.run(application, name="scorer", route_prefix="/")
        yield Server(model, f"127.0.0.1:{port}", handle.describe.remote().result())
    finally:
        started = psutil.Process().children(recursive=True)  # Ray's daemons, the proxy, the replica
        serve.shutdown()
        ray.shutdown()
    assert not _wait_gone(started), "Ray processes outlived ray.shutdown()"


@pytest.fixture
def client(server):
    with triton.InferenceServerClient(server.url, concurrency=32, connection_timeout=30, network_timeout=30) as c:
        yield c


def _inputs(x: np.ndarray, ids: np.ndarray, binary: bool = True) -> list[triton.InferInput]:
    inputs = [triton.InferInput("x", list(x.shape), "FP32"), triton.InferInput("ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(x, binary_data=binary)
    inputs[1].set_data_from_numpy(ids, binary_data=binary)
    return inputs


def _example(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 4), dtype=np.float32), rng.integers(0, 10, rows)


def _assert_matches(result: triton.InferResult, expected: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(result.as_numpy("scores"), expected["scores"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("best"), expected["best"])


def _stats(client: triton.InferenceServerClient) -> dict:
    return client.get_inference_statistics("scorer")["model_stats"][0]


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("scorer")
    meta = client.get_model_metadata("scorer")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "ids", "datatype": "INT64", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 3]},
                               {"name": "best", "datatype": "INT64", "shape": [-1]}]
    assert client.get_server_metadata()["name"] == "clika_runtime"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_gets_the_eager_numbers(server, client, binary):
    x, ids = _example(3, seed=1)
    outputs = None if binary else [triton.InferRequestedOutput(n, binary_data=False) for n in ("scores", "best")]
    result = client.infer("scorer", _inputs(x, ids, binary), outputs=outputs, request_id="req-1")
    _assert_matches(result, server.eager(x, ids))
    assert result.get_response()["id"] == "req-1"


def test_concurrent_requests_are_batched_and_split_back(server, client):
    before = _stats(client)
    examples = [_example(1, seed=100 + i) for i in range(32)]
    pending = [client.async_infer("scorer", _inputs(x, ids)) for x, ids in examples]
    for (x, ids), request in zip(examples, pending):
        _assert_matches(request.get_result(timeout=60), server.eager(x, ids))
    after = _stats(client)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 32
    assert executions <= inferences // 2, f"{executions} graph runs for 32 requests: not batched"
    assert 1 < max(b["batch_size"] for b in after["batch_stats"]) <= 16


def test_batches_stay_within_the_shipped_guard_and_larger_requests_get_400(server):
    assert server.plan == ("batching on dim 'x_dim0' (axis 0 of every input and output), up to 16 rows per run "
                           "(the graph's range for dim 'x_dim0' ends at 16), waiting at most 50 ms")
    status, answer = server.post("/v2/models/scorer/infer", json_body([x_entry(17), ids_entry(17, data=[0] * 17)]))
    assert (status, answer) == (400, {"error": "input 'x' axis 0: size 17 outside the graph's range [0, 16]"})
    status, answer = server.post("/v2/models/scorer/infer", json_body([x_entry(16), ids_entry(16, data=[0] * 16)]))
    assert status == 200 and answer["outputs"][0]["shape"] == [16, 3]


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[b.id for b in BAD_REQUESTS])
def test_malformed_requests_get_400_and_the_next_request_is_served(server, bad):
    headers = {} if bad.header_length is None else {"Inference-Header-Content-Length": bad.header_length}
    status, answer = server.post("/v2/models/scorer/infer", bad.body, headers)
    assert status == bad.status
    assert list(answer) == ["error"]
    assert re.search(bad.match, answer["error"]), answer["error"]
    assert "Traceback" not in answer["error"] and ".py" not in answer["error"]
    status, answer = server.post("/v2/models/scorer/infer", json_body([x_entry(), ids_entry()]))
    assert status == 200 and [o["name"] for o in answer["outputs"]] == ["scores", "best"]


def test_a_request_that_breaks_the_graph_gets_500_alone(server, client):
    examples = [_example(1, seed=200 + i) for i in range(6)]
    broken = (examples[0][0], np.array([42]))  # the embedding has 10 rows
    pending = [client.async_infer("scorer", _inputs(x, ids)) for x, ids in [broken, *examples]]
    with pytest.raises(InferenceServerException) as caught:
        pending[0].get_result(timeout=60)
    assert caught.value.status() == "500"
    assert caught.value.message() == "the graph failed on this request; the server's log has the details"
    for (x, ids), request in zip(examples, pending[1:]):
        _assert_matches(request.get_result(timeout=60), server.eager(x, ids))
    x, ids = _example(2, seed=300)
    _assert_matches(client.infer("scorer", _inputs(x, ids)), server.eager(x, ids))


def test_an_oversized_body_is_refused_unread_and_the_server_goes_on(server, client):
    connection = http.client.HTTPConnection(server.url, timeout=30)
    try:
        connection.putrequest("POST", "/v2/models/scorer/infer")
        connection.putheader("Content-Length", str(64 * 2**20))  # the test server's cap is 1 MiB
        connection.endheaders()
        connection.send(b"{" * 65536)
        response = connection.getresponse()
        assert response.status == 413
        assert json.loads(response.read()) == {
            "error": f"request body of {64 * 2**20} bytes is over the server's limit of {2**20} bytes"
        }
    finally:
        connection.close()
    x, ids = _example(4, seed=400)
    _assert_matches(client.infer("scorer", _inputs(x, ids)), server.eager(x, ids))


def test_unknown_models_paths_and_methods_get_v2_errors(server):
    connection = http.client.HTTPConnection(server.url, timeout=30)
    try:
        for method, path, status, message in [
            ("GET", "/v2/models/other", 404, "unknown model 'other'; this server serves 'scorer'"),
            ("GET", "/v2/models/scorer/infer", 405, "GET /v2/models/scorer/infer: this endpoint takes POST"),
        ]:
            connection.request(method, path)
            response = connection.getresponse()
            assert (response.status, json.loads(response.read())) == (status, {"error": message})
    finally:
        connection.close()


def test_the_replica_code_path_never_imports_torch(shipped):
    _, path = shipped
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from clika_runtime.kserve import deployment
        replica = deployment.KServeModel.func_or_class({str(path)!r}, "scorer", "cpu", 1, 5.0, 2**20)
        print(replica.describe())
        print("torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["not batching: at most 1 row per run; the graph could batch on dim 'x_dim0'",
                                          "False"]
    assert re.search(r"model 'scorer': warm-up run in [0-9.]+ ms", result.stderr), result.stderr  # before any request


def test_the_serve_command_serves_until_interrupted(shipped):
    _, path = shipped
    port = _free_port()
    command = [sys.executable, "-m", "clika_runtime", "serve", str(path), "--name", "cli", "--port", str(port),
               "--max-batch-size", "4", "--batch-wait-ms", "2.5"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: list[psutil.Process] = []
    try:
        line = _wait_for_line(process, "serving model", timeout=180)
        assert line == (f"serving model 'cli' at http://127.0.0.1:{port}/v2/models/cli: batching on dim 'x_dim0' "
                        "(axis 0 of every input and output), up to 4 rows per run, waiting at most 2.5 ms")
        children = psutil.Process(process.pid).children(recursive=True)
        with triton.InferenceServerClient(f"127.0.0.1:{port}") as client:
            x, ids = _example(2, seed=500)
            result = client.infer("cli", _inputs(x, ids))
            assert result.as_numpy("scores").shape == (2, 3)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert not _wait_gone(children), "Ray processes outlived clika-runtime serve"


@pytest.mark.slow
def test_a_replica_that_cannot_restart_answers_408_at_the_request_timeout(shipped, tmp_path):
    """Found under faults (issue 26): a replica killed after its graph file went cannot restart,
    and Serve held every request sent to it until the client gave up (forever, without one)."""
    _, path = shipped
    graph = tmp_path / "doomed.onnx"
    graph.write_bytes(Path(path).read_bytes())
    port = _free_port()
    command = [sys.executable, "-m", "clika_runtime", "serve", str(graph), "--name", "doomed", "--port", str(port),
               "--max-batch-size", "1", "--request-timeout-s", "5"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        _wait_for_line(process, "serving model", timeout=180)
        graph.unlink()
        replicas = [p for p in psutil.Process(process.pid).children(recursive=True)
                    if any("ServeReplica:doomed" in part for part in _cmdline(p))]
        assert replicas, "no replica process found"
        for replica in replicas:
            replica.kill()
        started = time.monotonic()
        connection = http.client.HTTPConnection(f"127.0.0.1:{port}", timeout=60)
        try:
            connection.request("POST", "/v2/models/doomed/infer", body=json_body([x_entry(1), ids_entry(1)]))
            status = connection.getresponse().status
        finally:
            connection.close()
        took = time.monotonic() - started
        assert status != 200 and took < 30, (status, took)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            process.kill()


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _wait_for_line(process: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = process.stdout.readline()
        if line.startswith(prefix):
            return line.rstrip("\n")
        if not line and process.poll() is not None:
            pytest.fail(f"clika-runtime serve exited with {process.returncode} before serving")
    pytest.fail(f"clika-runtime serve did not print {prefix!r} within {timeout} s")


# -- stopping `clika-runtime serve` at any moment (issue 25, item 4) ---------------------------------

_MARK = "CLIKA_RUNTIME_TEST_SERVE"  # inherited by every process the server starts, Ray's included


def _marked(mark: str) -> list[psutil.Process]:
    """The live processes the server with ``mark`` started, even those re-parented to init after
    their parent died: ``mark`` is in their environment, or, for those that renamed themselves
    (setproctitle overwrites the environment: Ray's agents, the dashboard's modules), it is the
    folder of their Ray's session (``RAY_TMPDIR``), where their log files are open."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(_MARK) == mark or any(f.path.startswith(mark) for f in p.open_files()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _start_serve(path: Path, port: int, mark: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "clika_runtime", "serve", str(path), "--name", "stop", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[_MARK] = env["RAY_TMPDIR"] = mark
    env["PYTHONFAULTHANDLER"] = "1"  # a server that hangs says where, on SIGABRT
    # Its own process group, so that a Ctrl-C can be sent as a terminal sends it: to the whole group.
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _get_status(port: int, path: str) -> int | None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):  # not listening yet, or not HTTP yet (a port still Ray's)
        return None
    finally:
        connection.close()


def _wait_ready(process: subprocess.Popen, port: int, timeout: float = 180) -> None:
    """Poll ``/v2/health/ready`` until it first answers 200 (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"clika-runtime serve exited with {process.returncode} before ready: "
                        f"{process.stderr.read().decode(errors='replace')[-3000:]}")
        if _get_status(port, "/v2/health/ready") == 200:
            return
        time.sleep(0.05)
    pytest.fail(f"/v2/health/ready did not answer 200 within {timeout} s")


def _stop_and_check(process: subprocess.Popen, mark: str, send, starting: bool = False) -> None:
    """Stop the server with ``send()``; it must exit 0 within 10 s and leave no process behind.

    ``starting``: a stop while Ray starts may also be ended by the stop's watchdog (exit -9, where
    it stood printed) past its 8 s: Ray's C++ constructors run holding the GIL, and one stood 60 s
    after a SIGTERM (in CI; here 3 in 31 stops under load while Ray's failure signal handler was
    installed, none in 30 since). Said as a warning, so that it shows."""
    started = time.monotonic()
    send()
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # faulthandler prints where each thread stands
        process.wait(timeout=30)
        pytest.fail("clika-runtime serve did not exit within 60 s of the signal; where it stood: "
                    f"{process.stderr.read().decode(errors='replace')[-6000:]}")
    took = time.monotonic() - started
    stderr = process.stderr.read().decode(errors="replace")
    left = _marked(mark)
    _, alive = psutil.wait_procs(left, timeout=3)  # a process already on its way out
    left_names = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in alive if p.is_running()]
    if starting and code == -signal.SIGKILL and "the stop did not end within" in stderr:
        warnings.warn(f"the stop's watchdog ended the server after {took:.1f} s: {stderr[-3000:]}")
    else:
        assert code == 0, f"exit code {code}: {stderr[-3000:]}"
    assert took < 10, f"{took:.1f} s to stop: {stderr[-3000:]}"
    assert not left_names, f"processes left behind: {left_names}"
    assert "Traceback" not in stderr and "Controller failed to shut down" not in stderr, stderr[-3000:]
    print(f"stopped in {took:.2f} s")


@pytest.fixture
def serve_process(shipped):
    """A ``clika-runtime serve`` subprocess, its port and its mark; whatever survives the test is killed."""
    _, path = shipped
    # A folder of its own, its path the mark: Ray's sockets go in it, so it must be short (/tmp).
    port, mark = _free_port(), tempfile.mkdtemp(prefix="cr-serve-", dir="/tmp")
    process = _start_serve(path, port, mark)
    try:
        yield process, port, mark
    finally:
        for p in _marked(mark):  # only the processes this test started carry the mark
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        shutil.rmtree(mark, ignore_errors=True)


def test_sigterm_right_after_ready_exits_0_quickly_and_leaves_nothing(serve_process):
    process, port, mark = serve_process
    _wait_ready(process, port)
    _stop_and_check(process, mark, lambda: process.send_signal(signal.SIGTERM))


def test_ctrl_c_right_after_ready_exits_0_quickly_and_leaves_nothing(serve_process):
    process, port, mark = serve_process
    _wait_ready(process, port)
    # A terminal's Ctrl-C: SIGINT to the foreground process group, Ray's processes included.
    _stop_and_check(process, mark, lambda: os.killpg(process.pid, signal.SIGINT))


def test_sigint_right_after_ready_exits_0_quickly_and_leaves_nothing(serve_process):
    process, port, mark = serve_process
    _wait_ready(process, port)
    _stop_and_check(process, mark, lambda: process.send_signal(signal.SIGINT))


def test_ready_serves_at_once_and_sigterm_after_a_burst_stops_quickly(serve_process, shipped):
    model, _ = shipped
    process, port, mark = serve_process
    _wait_ready(process, port)
    # Ready means ready: the requests sent the moment it first answers 200 are served.
    examples = [_example(1 + i % 3, seed=600 + i) for i in range(48)]
    with triton.InferenceServerClient(f"127.0.0.1:{port}", concurrency=16, connection_timeout=30,
                                      network_timeout=30) as client:
        pending = [client.async_infer("stop", _inputs(x, ids)) for x, ids in examples]
        for (x, ids), request in zip(examples, pending):
            with torch.no_grad():
                expected = {k: v.numpy() for k, v in model(torch.from_numpy(x), torch.from_numpy(ids)).items()}
            _assert_matches(request.get_result(timeout=60), expected)
    _stop_and_check(process, mark, lambda: process.send_signal(signal.SIGTERM))


def _until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    pytest.fail(f"{what} within {timeout} s")


def _ray_imports(process: subprocess.Popen, mark: str) -> None:
    """Until Ray's core library is loaded, while the rest of Ray and Serve still import (a second
    or more, before ``run`` is reached): a stop then ended the command with -15 (SIGTERM's default)."""
    maps = Path(f"/proc/{process.pid}/maps")
    if not maps.parent.exists():
        pytest.skip("needs /proc to see what the server has loaded")
    _until(lambda: "_raylet" in maps.read_text() or process.poll() is not None, "Ray's library was not loaded")


def _ray_starts(process: subprocess.Popen, mark: str) -> None:
    """Until the server starts its first process: ``ray.init`` is running."""
    _until(lambda: psutil.Process(process.pid).children() or process.poll() is not None, "Ray did not start")


def _raylet_has_children(process: subprocess.Popen, mark: str) -> None:
    """Until the raylet starts its first child (its dashboard and runtime-env agents), while
    ``ray.init`` waits for the raylet: a stop then left both agents behind, re-parented to init."""

    def started() -> bool:
        for p in _marked(mark):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(p.ppid()).name() == "raylet":
                    return True
        return process.poll() is not None

    _until(started, "the raylet started no process")


@pytest.mark.parametrize("wait", [_ray_imports, _ray_starts, _raylet_has_children],
                         ids=["while-ray-imports", "as-ray-starts", "as-the-raylet-starts-agents"])
def test_sigterm_during_startup_stops_quickly_and_leaves_nothing(serve_process, wait):
    process, port, mark = serve_process
    wait(process, mark)
    assert process.poll() is None, f"exited with {process.returncode} before the signal"
    _stop_and_check(process, mark, lambda: process.send_signal(signal.SIGTERM), starting=True)


@pytest.mark.parametrize("holder", ["a-ray-serve", "another-program"])
def test_serve_on_a_port_in_use_exits_2_naming_it(server, client, shipped, holder):
    """Ray Serve binds its port with SO_REUSEPORT: a second server on the port of a running one
    started, shared the port, and took part of its requests (the kernel splits connections); on a
    port another program holds, it failed after Ray's startup with a traceback and exit 1."""
    _, path = shipped
    held = socket.socket()
    if holder == "a-ray-serve":
        port = int(server.url.rsplit(":", 1)[1])
    else:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
    mark = tempfile.mkdtemp(prefix="cr-serve-", dir="/tmp")
    with held:
        process = _start_serve(path, port, mark)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            for p in [process, *_marked(mark)]:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(p.pid).kill()
            process.wait(timeout=30)
            shutil.rmtree(mark, ignore_errors=True)
    stderr = process.stderr.read().decode(errors="replace")
    assert code is not None, "a second server on the port still ran after 60 s"
    assert code == 2, f"exit code {code}: {stderr[-3000:]}"
    assert f"127.0.0.1:{port} is in use" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert client.is_server_ready()  # the server that held the port goes on
