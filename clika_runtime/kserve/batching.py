"""Dynamic batching: stack requests along the graph's batch dim, run once, split the outputs back.

Pure numpy; the Ray Serve deployment decides *when* to run (``@serve.batch``), this module *how*.
Requests are stacked only when their non-batch dims and dtypes agree (each such group runs on its
own), and only for graphs whose every input and output has the same dynamic dim on axis 0 and
nowhere else: that is what makes rows independent slots to fill and read back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union

import numpy as np

from clika_runtime.kserve.protocol import Model, Tensor

logger = logging.getLogger("clika_runtime")

Feeds = Mapping[str, np.ndarray]
Outcome = Union[dict[str, np.ndarray], Exception]  # the outputs of one request, or why it failed
Runner = Callable[[Feeds], Mapping[str, Any]]  # ServedGraph.run


@dataclass(frozen=True)
class Request:
    """One checked inference request waiting for a graph run."""

    feeds: dict[str, np.ndarray]
    rows: int  # inferences it holds: its size on the batch dim, or 1 for a graph that cannot batch
    arrived_ns: int = field(default_factory=time.perf_counter_ns)


@dataclass(frozen=True)
class Execution:
    """One successful graph run: how many rows it served and how long it took."""

    rows: int
    ns: int


class Plan(NamedTuple):
    """How a replica serves a model's requests."""

    dim: str | None  # the batch dim, when the graph has one
    stacks: bool  # whether requests go through the batch queue to share runs
    max_rows: int  # the most rows one stacked run holds
    sentence: str  # the above in words, for the log and the serve command


def plan(
    model: Model, max_batch_size: int, batch_wait_ms: float, ranges: Sequence[tuple[str, int, int | None]] = ()
) -> Plan:
    """Batch when the graph has a batch dim and a run may hold more than one row (otherwise a
    request would wait out the batch wait for nothing), never past the end of the dim's range in
    the graph's guard (``Guard.ranges``): a stacked run the graph refuses would only be retried."""
    dim, why = batch_dim(model)
    if dim is None:
        return Plan(None, False, 0, why)
    highest = min((hi for name, _, hi in ranges if name == dim and hi is not None), default=None)
    max_rows = max_batch_size if highest is None else max(1, min(max_batch_size, highest))
    capped = "" if max_rows == max_batch_size else f" (the graph's range for dim {dim!r} ends at {highest})"
    if max_rows == 1:
        return Plan(dim, False, 1, f"not batching: at most 1 row per run{capped}; the graph could batch on dim {dim!r}")
    return Plan(dim, True, max_rows,
                f"{why}, up to {max_rows} rows per run{capped}, waiting at most {batch_wait_ms:g} ms")


def batch_dim(model: Model) -> tuple[str | None, str]:
    """The dim requests can be stacked along, or ``None``; and a sentence saying which and why."""
    tensors = [("input", t) for t in model.inputs] + [("output", t) for t in model.outputs]
    for kind, tensor in tensors:
        if _axis0(tensor) is None:
            return None, f"cannot batch: {kind} {tensor.name!r} {_why_not(tensor)}; requests run one by one"
    dims = {_axis0(t) for _, t in tensors}
    if len(dims) != 1:
        return None, f"cannot batch: axis 0 is not one dim across inputs and outputs ({sorted(dims)}); requests run one by one"
    dim = dims.pop()
    for kind, tensor in tensors:
        if dim in tensor.shape[1:]:
            return None, f"cannot batch: {kind} {tensor.name!r} uses dim {dim!r} beyond axis 0; requests run one by one"
    return dim, f"batching on dim {dim!r} (axis 0 of every input and output)"


def _axis0(tensor: Tensor) -> str | None:
    return tensor.shape[0] if tensor.shape and isinstance(tensor.shape[0], str) else None


def _why_not(tensor: Tensor) -> str:
    if not tensor.shape:
        return "is a scalar"
    if isinstance(tensor.shape[0], int):
        return f"has a static axis 0 (size {tensor.shape[0]})"
    return "has an unnamed dynamic axis 0"


def rows_of(requests: Sequence[Request]) -> int:
    """What a batch of requests counts against the maximum batch size: its rows, and at least one
    per request (so requests of zero rows cannot pile up without bound)."""
    return sum(max(1, r.rows) for r in requests)


def run_batch(run: Runner, requests: Sequence[Request]) -> tuple[list[Outcome], list[Execution]]:
    """Serve ``requests`` with as few runs as their shapes allow; one outcome per request, in order.

    A stacked run that fails is retried request by request, so a request that breaks the graph
    fails alone and the others in its batch are still served.
    """
    outcomes: dict[int, Outcome] = {}
    executions: list[Execution] = []
    for members in _groups(requests):
        group = [requests[i] for i in members]
        outcomes.update(zip(members, _run_group(run, group, executions)))
    return [outcomes[i] for i in range(len(requests))], executions


def _groups(requests: Sequence[Request]) -> list[list[int]]:
    """Indices of requests that can be stacked together: same dtypes and same non-batch dims."""
    groups: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
        key = tuple((name, a.dtype.str, a.shape[1:]) for name, a in request.feeds.items())
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def _run_group(run: Runner, group: Sequence[Request], executions: list[Execution]) -> list[Outcome]:
    if len(group) > 1:
        try:
            return _run_stacked(run, group, executions)
        except Exception as e:  # one of them may have broken the run: find it by running each alone
            logger.info("a batch of %d requests failed (%s); running them one by one", len(group), type(e).__name__)
    return [_run_alone(run, request, executions) for request in group]


def _run_stacked(run: Runner, group: Sequence[Request], executions: list[Execution]) -> list[Outcome]:
    names = list(group[0].feeds)
    stacked = {n: np.concatenate([r.feeds[n] for r in group]) for n in names}
    total = sum(r.rows for r in group)
    outputs = _timed(run, stacked, total, executions)
    bounds = np.cumsum([r.rows for r in group])[:-1]
    split: dict[str, list[np.ndarray]] = {}
    for name, array in outputs.items():
        if np.shape(array)[:1] != (total,):
            raise RuntimeError(f"output {name!r} has shape {np.shape(array)} for a batch of {total} rows")
        split[name] = np.split(array, bounds)
    return [{name: parts[i] for name, parts in split.items()} for i in range(len(group))]


def _run_alone(run: Runner, request: Request, executions: list[Execution]) -> Outcome:
    try:
        return dict(_timed(run, request.feeds, request.rows, executions))
    except Exception as e:  # answered to that request alone; the server goes on
        return e


def _timed(run: Runner, feeds: Feeds, rows: int, executions: list[Execution]) -> Mapping[str, Any]:
    start = time.perf_counter_ns()
    outputs = run(feeds)
    executions.append(Execution(rows, time.perf_counter_ns() - start))
    return outputs
