"""The Ray Serve deployment that serves one shipped graph over the KServe v2 HTTP protocol.

Each replica loads the graph with ``clika_runtime.load`` (numpy in, numpy out: torch is never
imported on this path), parses requests with ``protocol``, and hands checked requests to Ray
Serve's ``@serve.batch``, which gathers concurrent ones for up to the batch wait; ``batching``
stacks them into as few graph runs as their shapes allow. The graph runs in a worker thread so the
replica keeps reading requests (and forming the next batch) meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.serve import Application
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from clika_runtime.base.errors import GraphFileError, GraphInputError, ProtocolError, ServeError
from clika_runtime.kserve import batching, protocol, routes, stopping
from clika_runtime.kserve.stats import Statistics
from clika_runtime.shipped.served import load

logger = logging.getLogger("clika_runtime")

_MIB = 2**20
_DRAIN_S = 3.0  # how long a stopping replica lets the requests it is running finish
_SHUTDOWN_S = _DRAIN_S + 2.0  # how long Serve has to stop its replicas and proxy before Ray is shut down anyway
_REAP_S = 0.5  # how long what Ray started has to exit once Ray is shut down, then after a SIGTERM, before a SIGKILL
_STOP_S = 8.0  # how long a stop may take, Serve's drain and the reaping included, before it is cut short
_PORT_WAIT_S = 5.0  # how long a port in use may take to be freed (a server still stopping there) before we give up


@serve.deployment
class KServeModel:
    """One replica serving one graph: the v2 endpoints, batching and statistics."""

    def __init__(
        self, path: str, name: str, place: str, max_batch_size: int, batch_wait_ms: float, max_request_bytes: int,
        body_timeout_s: float = routes.BODY_TIMEOUT_S,
    ) -> None:
        self._graph = load(path, place)
        self._model = protocol.Model.from_graph(name, self._graph.inputs, self._graph.outputs)
        self._plan = batching.plan(self._model, max_batch_size, batch_wait_ms, self._graph.guard.ranges)
        self._max_bytes = max_request_bytes
        self._body_timeout_s = body_timeout_s
        self._stats = Statistics()
        # @serve.batch takes its sizes at class definition; these are the sizes this app was built with.
        self._stacked.set_max_batch_size(self._plan.max_rows)
        self._stacked.set_batch_wait_timeout_s(batch_wait_ms / 1000)
        logger.log(logging.INFO if self._plan.stacks else logging.WARNING, "model %r: %s", name, self._plan.sentence)
        # Ready means ready: Ray Serve routes no request here (ready included) before this returns,
        # so the first request finds a session that has already run (and paid its first run).
        _warm_up(self._graph, name)

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
            body = await routes.read_body(request.headers, request.stream(), self._max_bytes, self._body_timeout_s)
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


def _warm_up(graph: Any, name: str) -> None:
    """One run of the graph on zeros at its capture's example sizes (lifted numbers at their
    example value); a graph that refuses them is only logged: requests are its judge."""
    example = dict(graph.guard.example)
    feeds = {}
    for rule in graph.guard.inputs:
        if rule.shape is None:  # a lifted Python number
            feeds[rule.name] = np.asarray(example.get(f"#{rule.name}", 0), dtype=np.int64)
            continue
        shape = [d if isinstance(d, int) else example.get(d, 1) for d in rule.shape]
        feeds[rule.name] = np.zeros(shape, dtype=rule.dtype)  # the protocol took it
    started = time.perf_counter()
    try:
        graph.run(feeds)
    except Exception as e:  # zeros the graph refuses or fails on: requests will say more
        logger.warning("model %r: the warm-up run on zeros failed: %s", name, e)
        return
    logger.info("model %r: warm-up run in %.1f ms", name, (time.perf_counter() - started) * 1000)


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
    body_timeout_s: float = routes.BODY_TIMEOUT_S,
) -> Application:
    """A Ray Serve application serving the graph at ``path`` over the KServe v2 HTTP protocol.

    ``name`` (default: the file's stem) is the model name in URLs. Concurrent requests are stacked
    along the graph's batch dim up to ``max_batch_size`` rows, waiting at most ``batch_wait_ms``
    for a batch to fill. ``replicas`` copies each load the file on ``place``; on a cluster, the
    path must exist on every node. Bodies over ``max_request_mb`` are refused before being read, and
    bodies not received within ``body_timeout_s`` are refused with 408 (a stalled client otherwise
    holds one of the replica's request slots for as long as it keeps the connection).
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
    _require(body_timeout_s > 0, f"body_timeout_s must be > 0, got {body_timeout_s}")
    deployment = KServeModel.options(
        name=f"{name}_v2",
        num_replicas=replicas,
        ray_actor_options=_resources(place),
        # Requests waiting in the batch queue count as ongoing: leave room for several batches.
        max_ongoing_requests=max(64, 4 * max_batch_size),
        # On a stop, a replica checks for requests still running every wait loop (Serve's default:
        # 2 s, so a stop took 2 s even when idle), and gives them up to the timeout to finish.
        graceful_shutdown_wait_loop_s=0.1,
        graceful_shutdown_timeout_s=_DRAIN_S,
    )
    return deployment.bind(
        str(path), name, place, max_batch_size, batch_wait_ms, int(max_request_mb * _MIB), body_timeout_s
    )


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
    request_timeout_s: float | None = 60.0,
) -> None:
    """Serve the graph at ``path`` on ``http://host:port`` until SIGINT or SIGTERM (``clika-runtime serve``).

    A request not answered within ``request_timeout_s`` gets 408 from Serve's proxy (``None``: no
    limit): a replica that dies and cannot restart (its graph file gone) would otherwise hold
    every request sent to it until the client gives up.

    Joins the Ray cluster named by ``RAY_ADDRESS``; without it, starts a local Ray of its own (never
    one that someone else started on this machine). A stop at any moment, starting included, removes
    the application and shuts down Serve and Ray when it started them, within a few seconds, leaving
    no process behind; the function then returns normally. A stop not over 8 s after its signal
    is cut short from outside, even one stuck in C code: where each thread stood is printed, and
    every process the server started is killed, then the server (SIGKILL, exit status 137).
    """
    _require(request_timeout_s is None or request_timeout_s > 0,
             f"request_timeout_s must be > 0 (or None: no limit), got {request_timeout_s}")
    application = app(
        path, name=name, place=place, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
        replicas=replicas, max_request_mb=max_request_mb,
    )
    name = _model_name(path, name)
    joined = bool(os.environ.get("RAY_ADDRESS"))
    stop = stopping.Stop(deadline_s=_STOP_S)  # its watchdog starts before ``before`` is listed: never reaped
    deployed = False
    with stopping.adopting_orphans() as before:
        try:
            _start(stop, joined, {"host": host, "port": port, **({"request_timeout_s": request_timeout_s}
                                                                 if request_timeout_s else {})})
            try:
                deployed = True
                handle = serve.run(application, name=name, route_prefix="/")
            except RuntimeError as e:  # Ray's words for a replica that failed to start; its error is logged above
                raise ServeError(f"model {name!r} did not start: {e} "
                                 "(the replica's error is in the log above)") from None
            stop.check()
            print(f"serving model {name!r} at http://{host}:{port}/v2/models/{name}: "
                  f"{handle.describe.remote().result()}", flush=True)
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop.ignore()  # a second Ctrl-C must not cut the shutdown short and leave processes behind
            try:
                _shut_down(name, joined, deployed, before)
            finally:
                stop.restore()


def _start(stop: stopping.Stop, joined: bool, http: dict[str, Any]) -> None:
    """Ray (a local one of our own, or the cluster joined) and Serve's HTTP proxy, with our stop
    handler in place throughout."""
    stop.install()  # before Ray starts: a stop while it starts is a stop, not Ray's abort
    if not joined:  # on a cluster, Serve's proxies listen on its nodes, not here
        _wait_for_port(http["host"], http["port"], _PORT_WAIT_S)
    with stopping.ray_keeps_our_handlers():
        ray.init(address=None if joined else "local")
    stop.install()  # again: the core worker's C handler, if Ray installed one anyway
    stop.check()
    serve.start(http_options=http)
    stop.check()


def _wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` can be listened on; raise ``ServeError`` if it is still in use
    after ``timeout_s`` (a server still stopping there frees it within seconds), or unusable.

    Ray Serve's proxy binds its port with SO_REUSEPORT: a second server on the port of a running
    one bound it too and silently took part of its requests. On a port another program holds,
    the proxy failed only once Ray had started, with a traceback."""
    deadline = time.monotonic() + timeout_s
    while True:
        error = _bind_error(host, port)
        if error is None:
            return
        if error.errno != errno.EADDRINUSE:
            raise ServeError(f"cannot listen on {host}:{port}: {error.strerror or error}")
        if time.monotonic() >= deadline:
            raise ServeError(f"{host}:{port} is in use: another server or program listens there "
                             f"(waited {timeout_s:g} s for it to be freed); stop it or choose another --port")
        time.sleep(0.2)


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a socket cannot be bound to ``host:port`` (none: it can), as Serve's proxy binds it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return OSError(errno.EADDRNOTAVAIL, f"{host!r} does not resolve: {e}")
    with socket.socket(family, kind, proto) as probe:
        if os.name == "posix":  # past connections in TIME_WAIT do not keep a port busy (they do not stop Serve)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return e
    return None


def _shut_down(name: str, joined: bool, deployed: bool, before: set[Any]) -> None:
    """Remove the application; on a Ray of our own, stop Serve (bounded) and Ray with all its processes."""
    if ray.is_initialized():
        try:
            if joined:
                if deployed:
                    serve.delete(name)
            else:
                _stop_serve(_SHUTDOWN_S)
        except Exception as e:  # Serve half started or already gone: Ray's shutdown below still runs
            logger.warning("stopping Ray Serve: %s: %s", type(e).__name__, e)
    ray.shutdown()  # kills the processes this process started (none when it joined a cluster)
    stopping.reap(before, _REAP_S)  # and what they were starting, orphaned when a stop came mid-start


def _stop_serve(timeout_s: float) -> None:
    """``serve.shutdown()``, waiting at most ``timeout_s`` for the controller (Serve's own wait is 30 s)."""
    from ray.serve import context

    client = getattr(context, "_global_client", None)
    if client is None or not hasattr(client, "shutdown"):
        serve.shutdown()
        return
    client.shutdown(timeout_s=timeout_s)
    context._disconnect()
