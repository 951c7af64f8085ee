"""The statistics extension: one replica's counts in Triton's JSON shape for model statistics.

``inference_count`` counts inferences (each row of a request on the batch dim is one; a graph that
cannot batch counts one per request), ``execution_count`` counts graph runs: under load with
batching, the second grows much slower than the first. Only the durations measured here are
reported (success, fail, queue, compute_infer); Triton's compute_input, compute_output and cache
entries are left out rather than reported as zeros.
"""

from __future__ import annotations

import time
from typing import Any

from clika_runtime.kserve.protocol import MODEL_VERSION


class Statistics:
    """Counters of one replica. Not thread-safe: the replica updates them from its event loop only."""

    def __init__(self) -> None:
        self.inference_count = 0
        self.execution_count = 0
        self._last_inference_ms = 0
        self._durations = {key: [0, 0] for key in ("success", "fail", "queue", "compute_infer")}
        self._batches: dict[int, list[int]] = {}  # rows per run -> [count, ns]

    def answered(self, ok: bool, ns: int, inferences: int) -> None:
        """An inference request was answered: successfully with ``inferences`` rows, or with an error."""
        _add(self._durations["success" if ok else "fail"], ns)
        if ok:
            self.inference_count += inferences
            self._last_inference_ms = time.time_ns() // 1_000_000

    def queued(self, ns: int) -> None:
        """A request waited ``ns`` between being parsed and its graph run starting."""
        _add(self._durations["queue"], ns)

    def executed(self, rows: int, ns: int) -> None:
        """The graph ran once, successfully, on ``rows`` rows in ``ns``."""
        self.execution_count += 1
        _add(self._durations["compute_infer"], ns)
        _add(self._batches.setdefault(rows, [0, 0]), ns)

    def as_json(self, name: str) -> dict[str, Any]:
        """``GET /v2/models/{name}/stats``: ``{"model_stats": [...]}`` as Triton writes it."""
        return {"model_stats": [{
            "name": name,
            "version": MODEL_VERSION,
            "last_inference": self._last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {key: _duration(value) for key, value in self._durations.items()},
            "batch_stats": [
                {"batch_size": rows, "compute_infer": _duration(value)} for rows, value in sorted(self._batches.items())
            ],
        }]}


def _add(counter: list[int], ns: int) -> None:
    counter[0] += 1
    counter[1] += ns


def _duration(counter: list[int]) -> dict[str, int]:
    return {"count": counter[0], "ns": counter[1]}
