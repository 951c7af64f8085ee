"""Keeping the exporter's and the rewriter's chatter off the user's console."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from typing import Any, Iterator, TextIO

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
_quieted: dict[int, int] = {}  # thread id -> how many quiet() blocks it is in


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the exporter's prints (torch.export prints a failed trace's partial FX graph to
    stderr), log records and registration warnings off the user's console.

    Prints are dropped for the threads inside the block only: what other threads print meanwhile
    (a server's request logs) reaches the console. Warning filters and log levels are
    process-wide: nested and concurrent uses (an export, a fusion in another thread) share one
    quieting, set by the first and undone by the last, so none of them restores another's sink."""
    global _depth, _active
    me = threading.get_ident()
    with _lock:
        if _depth == 0:
            _active = _silenced()
        _depth += 1
        _quieted[me] = _quieted.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _quieted[me] -= 1
            if not _quieted[me]:
                del _quieted[me]
            _depth -= 1
            if _depth == 0 and _active is not None:
                _active.close()
                _active = None


class _Muted:
    """A stream that drops what the quieted threads write and passes on what others write."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return len(text) if threading.get_ident() in _quieted else self.stream.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, encoding, isatty...: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def _muted(name: str) -> Iterator[None]:
    stream = getattr(sys, name)
    if stream is None:  # no console (pythonw, a daemon): print() already writes nothing
        yield
        return
    muted = _Muted(stream)
    setattr(sys, name, muted)
    try:
        yield
    finally:
        if getattr(sys, name) is muted:  # not replaced by someone else meanwhile
            setattr(sys, name, stream)


def _silenced() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(_muted("stdout"))
    stack.enter_context(_muted("stderr"))
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
