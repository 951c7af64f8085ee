"""Keeping the exporter's and the rewriter's chatter off the user's console."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import warnings
from typing import Iterator

# "torch" holds torch.export's, dynamo's and fx's loggers (a data-dependent trace logs a warning
# from torch.fx.experimental.symbolic_shapes): children left at NOTSET follow it, those a user set
# with TORCH_LOGS keep their own level. What fails reaches the user as our error, with its fix.
_QUIETED = ("torch", "torch.onnx", "onnxscript", "onnx_ir")
# torch's structured trace (TORCH_TRACE, read by tlparse): a record per traced step, printed by the
# handlers test runners attach to it; left alone when a trace is asked for.
_TRACE = "torch.__trace"

_lock = threading.Lock()
_depth = 0
_active: contextlib.ExitStack | None = None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the exporter's prints (torch.export prints a failed trace's partial FX graph to
    stderr), log records and registration warnings off the user's console.

    Streams, warning filters and log levels are process-wide: nested and concurrent uses (an
    export, a fusion in another thread) share one quieting, set by the first and undone by the last,
    so none of them restores another's sink."""
    global _depth, _active
    with _lock:
        if _depth == 0:
            _active = _silenced()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _active is not None:
                _active.close()
                _active = None


def _silenced() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore", FutureWarning)  # torch-internal deprecations, not the user's
    warnings.simplefilter("ignore", RuntimeWarning)  # numpy noise from constant folding (log(0)...)
    # The training flag is part of the capture key: exporting a training-mode module is intended.
    warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
    for name in _QUIETED if os.environ.get("TORCH_TRACE") else (*_QUIETED, _TRACE):
        logger = logging.getLogger(name)
        stack.callback(logger.setLevel, logger.level)
        logger.setLevel(max(logger.level, logging.CRITICAL))
    return stack
