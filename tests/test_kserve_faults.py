"""The KServe v2 server under faults, on 127.0.0.1: stalled and vanishing clients, bodies at the size
limit, a replica killed under load (issue 26, item 3).

One Ray instance for the module, as in test_kserve_server.py; every socket and request has a
timeout, and each load lasts a few seconds. The replica kill runs last: it restarts the replica.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from typing import NamedTuple

import numpy as np
import psutil
import pytest
import ray
import torch
from ray import serve

import clika_runtime as cr
from clika_runtime import kserve
from test_kserve_server import Scorer, _free_port, _wait_gone

pytestmark = pytest.mark.slow

LIMIT = 2**20  # the fixture's --max-request-mb 1
BODY_TIMEOUT_S = 2.0
SLOTS = 64  # the deployment's max_ongoing_requests for max_batch_size 8
INFER = "/v2/models/scorer/infer"


class Case(NamedTuple):
    body: bytes  # a one-row JSON request
    scores: np.ndarray  # what eager torch answers


class Server(NamedTuple):
    port: int
    cases: list[Case]

    def post(self, body, *, timeout: float = 20.0, chunked: bool = False) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request("POST", INFER, body=body, encode_chunked=chunked)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def raw(self, head_bytes: int, body: bytes) -> socket.socket:
        """A connection that sent the headers of ``body`` and its first ``head_bytes`` bytes."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=20)
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % (INFER.encode(), len(body))
                     + body[:head_bytes])
        return sock


def _right(status: int, answer: bytes, case: Case) -> bool:
    if status != 200:
        return False
    scores = json.loads(answer)["outputs"][0]
    return bool(np.allclose(np.reshape(scores["data"], scores["shape"]), case.scores, rtol=1e-5, atol=1e-6))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.manual_seed(0)
    model = Scorer().eval()
    f = cr.compile(model)
    with torch.no_grad():
        f(torch.randn(2, 4), torch.randint(0, 10, (2,)))
        f(torch.randn(5, 4), torch.randint(0, 10, (5,)))
    path = f.take_graph().save(tmp_path_factory.mktemp("faults") / "scorer.onnx")
    rng = np.random.default_rng(0)
    cases = []
    for i in range(64):
        x, ids = rng.standard_normal((1, 4), dtype=np.float32), np.array([i % 10])
        with torch.no_grad():
            scores = model(torch.from_numpy(x), torch.from_numpy(ids))["scores"].numpy()
        body = json.dumps({"inputs": [
            {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x.ravel().tolist()},
            {"name": "ids", "shape": [1], "datatype": "INT64", "data": ids.tolist()}]}).encode()
        cases.append(Case(body, scores))
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        application = kserve.app(path, name="scorer", max_batch_size=8, batch_wait_ms=20, max_request_mb=1,
                                 body_timeout_s=BODY_TIMEOUT_S)
        serve.run(application, name="scorer", route_prefix="/")
        yield Server(port, cases)
    finally:
        started = psutil.Process().children(recursive=True)
        serve.shutdown()
        ray.shutdown()
    assert not _wait_gone(started), "Ray processes outlived ray.shutdown()"


def _status_line(sock: socket.socket) -> bytes:
    """The first line the server sends back on ``sock`` (empty if it closed without answering)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_bodies_at_the_limit_are_served_and_one_byte_past_gets_413(server):
    case = server.cases[0]
    at_limit = case.body + b" " * (LIMIT - len(case.body))  # JSON allows trailing blanks
    status, answer = server.post(at_limit)
    assert _right(status, answer, case), (status, answer[:200])
    assert server.post(at_limit + b" ") == (
        413, b'{"error": "request body of 1048577 bytes is over the server\'s limit of 1048576 bytes"}')

    def chunks(body: bytes):  # no Content-Length: the cap applies while the body streams in
        return (body[i:i + 65536] for i in range(0, len(body), 65536))

    status, answer = server.post(chunks(at_limit), chunked=True)
    assert _right(status, answer, case), (status, answer[:200])
    assert server.post(chunks(at_limit + b" "), chunked=True) == (
        413, b'{"error": "request body is over the server\'s limit of 1048576 bytes"}')
    assert _right(*server.post(case.body), case)


def test_one_stalled_client_and_many_idle_connections_block_nobody(server):
    case = server.cases[1]
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(200)]  # sent nothing
    stalled = server.raw(10, case.body)
    try:
        started = time.monotonic()
        assert _right(*server.post(case.body), case)
        assert time.monotonic() - started < BODY_TIMEOUT_S  # served while the stalled body is still awaited
    finally:
        for sock in [stalled, *idle]:
            sock.close()


def test_stalled_clients_in_every_slot_are_cut_with_408_and_the_others_served(server):
    case = server.cases[2]
    stalled = [server.raw(10, case.body) for _ in range(SLOTS + 6)]  # more than a replica takes at once
    try:
        time.sleep(0.5)
        started = time.monotonic()
        status, answer = server.post(case.body, timeout=15)
        waited = time.monotonic() - started
        assert _right(status, answer, case), (status, answer[:200])
        assert waited < BODY_TIMEOUT_S + 6, f"served after {waited:.1f} s behind the stalled clients"
        lines = {_status_line(sock) for sock in stalled[:SLOTS]}
        assert lines == {b"HTTP/1.1 408 Request Timeout"}, lines
    finally:
        for sock in stalled:
            sock.close()


def test_clients_that_vanish_mid_body_or_mid_batch_leave_the_others_served(server):
    for i in range(8):  # half a body, then gone
        server.raw(len(server.cases[i].body) // 2, server.cases[i].body).close()
    answers: dict[int, tuple[int, bytes]] = {}

    def ask(i: int) -> None:
        answers[i] = server.post(server.cases[i].body)

    vanishing = [server.raw(len(server.cases[i].body), server.cases[i].body) for i in range(8, 16)]
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16, 24)]
    for thread in threads:
        thread.start()
    time.sleep(0.01)  # inside the 20 ms batch wait: batched with the requests above
    for sock in vanishing:
        sock.close()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(answers) == list(range(16, 24))
    assert all(_right(*answers[i], server.cases[i]) for i in answers), answers


def test_a_body_cut_short_is_not_served_as_complete(server):
    case = server.cases[3]
    padded = case.body + b" " * 100  # the JSON is complete before the padding
    sock = server.raw(len(case.body), padded)
    try:
        sock.shutdown(socket.SHUT_WR)  # the client sent all it will: 100 bytes short of its Content-Length
        line = _status_line(sock)
    finally:
        sock.close()
    assert not line.startswith(b"HTTP/1.1 200"), line


def _replicas() -> list[psutil.Process]:
    """The replica processes of this test's Ray (descendants of this process: never another's)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any("ServeReplica:scorer" in part for part in p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


class Answer(NamedTuple):
    sent: float
    took: float
    outcome: str  # "right", "wrong", "5xx", another status, or the client's exception


def test_a_replica_killed_under_64_clients_fails_some_requests_with_5xx_and_none_wrong_or_hung(server):
    answers: list[Answer] = []
    stop = threading.Event()

    def client(case: Case) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status, answer = server.post(case.body, timeout=30)
                outcome = ("right" if _right(status, answer, case) else "wrong") if status == 200 else (
                    "5xx" if 500 <= status < 600 else str(status))
            except OSError as e:  # a timeout or a reset: not an answer
                outcome = type(e).__name__
            answers.append(Answer(sent, time.monotonic() - sent, outcome))

    (replica,) = _replicas()
    threads = [threading.Thread(target=client, args=(case,)) for case in server.cases]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        killed = time.monotonic()
        replica.send_signal(signal.SIGKILL)
        deadline = killed + 60
        while time.monotonic() < deadline and not any(
                a.sent > killed and a.outcome == "right" for a in answers):
            time.sleep(0.1)
        time.sleep(1.0)  # a second of load after the recovery
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=40)
    assert not any(thread.is_alive() for thread in threads), "a client hung past its 30 s timeout"
    outcomes = {o: sum(a.outcome == o for a in answers) for o in {a.outcome for a in answers}}
    recovered = min((a.sent + a.took for a in answers if a.sent > killed and a.outcome == "right"), default=None)
    failed = outcomes.get("5xx", 0) / len(answers)
    print(f"{len(answers)} requests, outcomes {outcomes}, failed {failed:.1%}, "
          f"recovered {None if recovered is None else round(recovered - killed, 2)} s after the kill")
    # 408: a request whose body the killed replica was reading waits past this fixture's 2 s body
    # timeout while the replica restarts (seen once in a clean-clone CI run, 7 of 506): refused in
    # words, neither wrong nor hung.
    assert set(outcomes) <= {"right", "5xx", "408"}, outcomes
    assert recovered is not None, "no request sent after the kill was answered within 60 s"
    (restarted,) = _replicas()
    assert restarted.pid != replica.pid
