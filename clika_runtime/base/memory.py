"""Giving freed memory back to the operating system after a capture's session goes.

A session's weights and buffers are freed when its capture is dropped (superseded by a drift
capture, evicted, reset), but glibc keeps freed heap memory for reuse: the process's RSS stays
high. ``give_back`` asks glibc to return it (``malloc_trim``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to ask
        return None


def give_back() -> None:
    """Return freed heap memory to the operating system where the C library can."""
    trim = _trim()
    if trim is not None:
        trim(0)
