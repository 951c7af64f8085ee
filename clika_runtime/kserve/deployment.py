"""The Ray Serve deployment that serves one shipped graph over the KServe v2 HTTP protocol.

Each replica loads the graph with ``clika_runtime.load`` (numpy in, numpy out: torch is never
imported on this path), parses requests with ``protocol``, and hands checked requests to Ray
Serve's ``@serve.batch``, which gathers concurrent ones for up to the batch wait; ``batching``
stacks them into as few graph runs as their shapes allow. The graph runs in a worker thread so the
replica keeps reading requests (and forming the next batch) meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

import ray
from ray import serve
from ray.serve import Application
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from clika_runtime.base.errors import GraphFileError, GraphInputError, ProtocolError, ServeError
from clika_runtime.kserve import batching, protocol, routes
from clika_runtime.kserve.stats import Statistics
from clika_runtime.shipped.served import load

logger = logging.getLogger("clika_runtime")

_MIB = 2**20


@serve.deployment
class KServeModel:
    """One replica serving one graph: the v2 endpoints, batching and statistics."""

    def __init__(
        self, path: str, name: str, place: str, max_batch_size: int, batch_wait_ms: float, max_request_bytes: int
    ) -> None:
        self._graph = load(path, place)
        self._model = protocol.Model.from_graph(name, self._graph.inputs, self._graph.outputs)
        self._plan = batching.plan(self._model, max_batch_size, batch_wait_ms, self._graph.guard.ranges)
        self._max_bytes = max_request_bytes
        self._stats = Statistics()
        # @serve.batch takes its sizes at class definition; these are the sizes this app was built with.
        self._stacked.set_max_batch_size(self._plan.max_rows)
        self._stacked.set_batch_wait_timeout_s(batch_wait_ms / 1000)
        logger.log(logging.INFO if self._plan.stacks else logging.WARNING, "model %r: %s", name, self._plan.sentence)

    def describe(self) -> str:
        """Whether this replica batches, and why (printed by ``clika-runtime serve`` at startup)."""
        return self._plan.sentence

    async def __call__(self, request: Request) -> Response:
        """Answer one HTTP request of the v2 protocol."""
        path = request.url.path[len(request.scope.get("root_path", "")):]
        try:
            endpoint = routes.route(request.method, path, self._model.name)
        except ProtocolError as e:
            return _error(e.status, str(e))
        if endpoint == "infer":
            return await self._infer(request)
        if endpoint == "metadata":
            return JSONResponse(protocol.model_metadata(self._model))
        if endpoint == "stats":
            return JSONResponse(self._stats.as_json(self._model.name))
        if endpoint == "server":
            return JSONResponse(protocol.server_metadata())
        return Response(status_code=200)  # live, ready, model ready: a replica serves only once loaded

    async def _infer(self, request: Request) -> Response:
        started = time.perf_counter_ns()
        rows = 0
        try:
            body = await routes.read_body(request.headers, request.stream(), self._max_bytes)
            header_length = request.headers.get(protocol.HEADER_LENGTH)
            # Each element takes at least one byte on the wire: a tensor of more elements than the
            # body cap could only come from a shape that lies about its data.
            parsed = protocol.parse_infer(self._model, body, header_length, max_elements=self._max_bytes)
            feeds = parsed.inputs
            # The guard decides alone for each request, so whether one is served never depends
            # on the requests it happens to be batched with.
            problem = self._graph.guard.check([feeds[n] for n in self._graph.guard.names])
            if problem is not None:
                raise GraphInputError(str(problem))
            rows = len(next(iter(feeds.values()))) if self._plan.dim else 1
            outcome = await self._execute(batching.Request(feeds, rows))
            if isinstance(outcome, Exception):
                raise outcome
            content, headers = protocol.encode_infer(self._model, parsed, outcome)
        except (ProtocolError, GraphInputError) as e:
            self._stats.answered(False, time.perf_counter_ns() - started, rows)
            return _error(getattr(e, "status", 400), str(e))
        except ClientDisconnect:
            return Response(status_code=499)  # nobody is listening; nginx's code for it
        except Exception:  # the graph failed on this request: answered alone, the replica goes on
            logger.exception("model %r: the graph failed on a request", self._model.name)
            self._stats.answered(False, time.perf_counter_ns() - started, rows)
            return _error(500, "the graph failed on this request; the server's log has the details")
        self._stats.answered(True, time.perf_counter_ns() - started, rows)
        return Response(content, headers=headers)

    async def _execute(self, request: batching.Request) -> batching.Outcome:
        if self._plan.stacks and request.rows <= self._plan.max_rows:
            return await self._stacked(request)
        return (await self._run([request]))[0]  # a request larger than a batch runs alone

    @serve.batch(batch_size_fn=batching.rows_of)
    async def _stacked(self, requests: list[batching.Request]) -> list[batching.Outcome]:
        return await self._run(requests)

    async def _run(self, requests: list[batching.Request]) -> list[batching.Outcome]:
        now = time.perf_counter_ns()
        for request in requests:
            self._stats.queued(now - request.arrived_ns)
        outcomes, executions = await asyncio.to_thread(batching.run_batch, self._graph.run, requests)
        for execution in executions:
            self._stats.executed(execution.rows, execution.ns)
        return outcomes


def _error(status: int, message: str) -> Response:
    return Response(routes.error_body(message), status_code=status, media_type="application/json")


def app(
    path: str | os.PathLike,
    /,
    *,
    name: str | None = None,
    place: str = "cpu",
    max_batch_size: int = 8,
    batch_wait_ms: float = 5.0,
    replicas: int = 1,
    max_request_mb: float = 64.0,
) -> Application:
    """A Ray Serve application serving the graph at ``path`` over the KServe v2 HTTP protocol.

    ``name`` (default: the file's stem) is the model name in URLs. Concurrent requests are stacked
    along the graph's batch dim up to ``max_batch_size`` rows, waiting at most ``batch_wait_ms``
    for a batch to fill. ``replicas`` copies each load the file on ``place``; on a cluster, the
    path must exist on every node. Bodies over ``max_request_mb`` are refused before being read.
    Run it with ``serve.run(app(...), route_prefix=...)`` or compose it into your own application.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise GraphFileError(f"{path}: no such file")
    name = _model_name(path, name)
    _require(max_batch_size >= 1, f"max_batch_size must be >= 1, got {max_batch_size}")
    _require(batch_wait_ms >= 0, f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
    _require(replicas >= 1, f"replicas must be >= 1, got {replicas}")
    _require(max_request_mb > 0, f"max_request_mb must be > 0, got {max_request_mb}")
    deployment = KServeModel.options(
        name=f"{name}_v2",
        num_replicas=replicas,
        ray_actor_options=_resources(place),
        # Requests waiting in the batch queue count as ongoing: leave room for several batches.
        max_ongoing_requests=max(64, 4 * max_batch_size),
    )
    return deployment.bind(str(path), name, place, max_batch_size, batch_wait_ms, int(max_request_mb * _MIB))


def _model_name(path: str | os.PathLike, name: str | None = None) -> str:
    """The model's name in URLs: ``name``, or the file's stem; checked to be URL-safe."""
    name = name or Path(path).stem
    protocol.check_model_name(name)
    return name


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ServeError(message)


def _resources(place: str) -> dict[str, float]:
    """What Ray reserves for a replica: one CPU, and one GPU when the graph runs on one."""
    on_gpu = place.lower().startswith(("cuda", "tensorrt"))
    return {"num_cpus": 1, "num_gpus": 1} if on_gpu else {"num_cpus": 1}


def run(
    path: str | os.PathLike,
    /,
    *,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    place: str = "cpu",
    max_batch_size: int = 8,
    batch_wait_ms: float = 5.0,
    replicas: int = 1,
    max_request_mb: float = 64.0,
) -> None:
    """Serve the graph at ``path`` on ``http://host:port`` until SIGINT or SIGTERM (``clika-runtime serve``).

    Joins the Ray cluster named by ``RAY_ADDRESS``; without it, starts a local Ray of its own (never
    one that someone else started on this machine). On stop, removes the application, and shuts
    down Serve and Ray when it started them.
    """
    application = app(
        path, name=name, place=place, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
        replicas=replicas, max_request_mb=max_request_mb,
    )
    name = _model_name(path, name)
    joined = bool(os.environ.get("RAY_ADDRESS"))
    ray.init(address=None if joined else "local")
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            handle = serve.run(application, name=name, route_prefix="/")
        except RuntimeError as e:  # Ray's words for a replica that failed to start; its error is logged above
            raise ServeError(f"model {name!r} did not start: {e} (the replica's error is in the log above)") from None
        print(f"serving model {name!r} at http://{host}:{port}/v2/models/{name}: {handle.describe.remote().result()}",
              flush=True)
        _wait_for_stop()
    finally:
        if joined:
            serve.delete(name)
        else:
            serve.shutdown()
        ray.shutdown()


def _wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM (a process manager stopping the server)."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass


def _interrupt(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt
