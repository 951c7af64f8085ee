"""Which file a capture's session opens: the graph with onnxruntime's fused kernels, or the portable one.

The fused graph (``exporters.save_fused``) is not always faster: measured on this project's
machine, BERT-base at (1, 512) runs in 0.83x the time of the portable graph and GPT-2 small within
3% either way, but a two-layer GPT-2 of width 128 runs 18% slower fused. So a small graph, where
two sessions and a few runs cost milliseconds, keeps the fused file only when it runs faster on
the capture's own call; a large one keeps it without measuring (a second session of a real-size
model would cost seconds and its weights' memory again).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np
import torch

import exporters
import serving
from clika_runtime.base.errors import first_line
from clika_runtime.shipped.folder import GraphFolder

logger = logging.getLogger("clika_runtime")

MEASURED_BELOW = 64 * 2**20  # weights' bytes under which the two graphs are timed against each other
_MARGIN = 0.97  # the fused graph must run in under 97% of the portable one's time to be kept
_BUDGET_S = 0.3  # seconds of timing at most (at least three rounds)


def fuse(exported: exporters.ExportedGraph, folder: GraphFolder, place: serving.Place) -> None:
    """Write the graph with onnxruntime's fused kernels for ``place`` beside the portable one, when
    any apply. A speed-up only: any failure of the rewriter leaves the portable graph to serve."""
    try:
        made = exporters.save_fused(exported.model, str(folder.path / folder.FUSED),
                                    for_cpu=place.primary == "CPUExecutionProvider")
    except Exception as e:  # the rewriter is not on the correctness path: never lose a capture to it
        logger.debug("no fused graph: %s: %s", type(e).__name__, first_line(e))
        folder.drop_fused()
        return
    if made:
        logger.debug("fused for onnxruntime: %s", ", ".join(f"{n} x{c}" for n, c in sorted(made.items())))


def keep_if_faster(folder: GraphFolder, place: serving.Place, names: Sequence[str], feeds: Sequence[Any],
                   threads: int | None) -> None:
    """Drop the fused graph of a small CPU capture unless it runs faster than the portable one on
    ``feeds`` (the capture's call). Anything that stops the timing keeps the files as they are."""
    if folder.opened == folder.model or place.primary != "CPUExecutionProvider":
        return
    try:
        inputs = _numpy(names, feeds)
        if inputs is None:
            return
        fused, portable = (serving.open_session(str(path), place, intra_op_threads=threads)
                           for path in (folder.opened, folder.model))
        ratio = _ratio(fused, portable, inputs)
    except Exception as e:  # a graph onnxruntime refuses is the session's business (capture._session)
        logger.debug("fused and portable graphs not timed: %s", first_line(e))
        return
    logger.debug("fused graph runs in %.2fx the portable one's time: %s", ratio,
                 "kept" if ratio < _MARGIN else "dropped")
    if ratio >= _MARGIN:
        folder.drop_fused()


def _numpy(names: Sequence[str], feeds: Sequence[Any]) -> dict[str, np.ndarray] | None:
    """The feeds as onnxruntime's ``run`` takes them; ``None`` where numpy cannot hold one (bfloat16)."""
    inputs = {}
    for name, feed in zip(names, feeds):
        if isinstance(feed, torch.Tensor):
            if feed.dtype == torch.bfloat16 or feed.device.type != "cpu":
                return None
            inputs[name] = feed.detach().numpy()
        else:
            inputs[name] = np.asarray(feed, dtype=np.int64)
    return inputs


def _ratio(fused: Any, portable: Any, inputs: dict[str, np.ndarray]) -> float:
    """Median over interleaved rounds of the fused graph's run time over the portable one's (a
    round runs each graph for about a millisecond at least: single microsecond runs are noise)."""
    first = [_timed(session, inputs, 1) for session in (fused, portable)]
    repeats = max(1, min(100, int(1e-3 / max(min(first), 1e-7))))
    ratios: list[float] = []
    started = time.perf_counter()
    while len(ratios) < 3 or (len(ratios) < 9 and time.perf_counter() - started < _BUDGET_S):
        ratios.append(_timed(fused, inputs, repeats) / max(_timed(portable, inputs, repeats), 1e-9))
    return float(np.median(ratios))


def _timed(session: Any, inputs: dict[str, np.ndarray], repeats: int) -> float:
    begin = time.perf_counter()
    for _ in range(repeats):
        session.run(None, inputs)
    return time.perf_counter() - begin
