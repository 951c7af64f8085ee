"""Keeping the exporter's and the rewriter's chatter off the user's console."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the exporter's progress prints and registration warnings off the user's console."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal deprecations, not the user's
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy noise from constant folding (log(0)...)
            # The training flag is part of the capture key: exporting a training-mode module is intended.
            warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
