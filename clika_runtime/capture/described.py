"""A cached capture in the words ``f.captures`` lists (``CaptureInfo``, as ``inspect`` uses for a saved graph)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from clika_runtime.base.specs import TensorInfo
from clika_runtime.shipped.describe import CaptureInfo, guard_text
from clika_runtime.trees.key import Lifted

if TYPE_CHECKING:
    from clika_runtime.capture.capture import Capture


def describe(capture: "Capture") -> CaptureInfo:
    """A cached capture in words."""

    key = capture.key
    tensors = iter(key.tensors)
    parts = []
    for rule in capture.guard.inputs:
        if rule.shape is not None:
            dtype, _, device, *_ = next(tensors)
            parts.append(f"{rule.name}: {str(dtype).replace('torch.', '')} on {device}")
    for name, static in zip(capture.described.static_names, key.statics):
        if not isinstance(static, Lifted):
            parts.append(f"{name}={_static_text(static)}")
    if key.training is not None:
        parts.append("training" if key.training else "eval")
    return CaptureInfo(
        key=", ".join(parts),
        inputs=tuple(TensorInfo(r.name, r.dtype, r.shape if r.shape is not None else ()) for r in capture.guard.inputs),
        outputs=capture.outputs,
        hits=capture.stats.hits,
        seconds_since_use=max(0.0, time.monotonic() - capture.stats.last_use),
        phases=dict(capture.stats.phases),
        guard=guard_text(capture.guard),
    )


def _static_text(static: Any) -> str:
    if static[0] == "snapshot":
        return f"{static[1].__name__}(...)"
    return repr(static[1]) if len(static) == 2 else repr(static[1]) if static[1] != ("nan",) else "nan"
