"""A cached capture in the words ``f.captures`` lists (``CaptureInfo``, as ``inspect`` uses for a saved graph)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from clika_runtime.base.specs import TensorInfo
from clika_runtime.shipped.describe import CaptureInfo, guard_text

if TYPE_CHECKING:
    from clika_runtime.capture.value import Capture


def describe(capture: "Capture") -> CaptureInfo:
    """A cached capture in words."""
    return CaptureInfo(
        key=capture.described.words(),
        inputs=tuple(TensorInfo(r.name, r.dtype, r.shape if r.shape is not None else ()) for r in capture.guard.inputs),
        outputs=capture.outputs,
        hits=capture.stats.hits,
        seconds_since_use=max(0.0, time.monotonic() - capture.stats.last_use),
        phases=dict(capture.stats.phases),
        guard=guard_text(capture.guard),
        precision=precision_words(capture),
    )


def precision_words(capture: "Capture") -> str:
    """What the capture's graph measured at its precision (its note where that precision does not
    serve), and how it disagreed with eager on a wider call since, if it did."""
    if capture.precision is None:
        return capture.precision_note or ""
    envelope = capture.parts.envelope
    later = envelope.disagreed if envelope is not None else None
    return str(capture.precision) + (f"; then disagreed on a wider call ({later}): calls that wide run eagerly"
                                     if later else "")
