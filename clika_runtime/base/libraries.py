"""The libraries a graph is made with, and what counts as the user's own code.

The disk cache keys these libraries by their versions (``cache/fingerprint.py``), and their code
and Python's own are taken as fixed; the user's code is keyed by content and its classes' state is
watched on every served call (``state/walk.py``).
"""

from __future__ import annotations

import sys
from typing import Any

LIBRARIES = ("torch", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "transformers")
_VERSIONED = frozenset(name.replace("-", "_") for name in LIBRARIES) | {"builtins"}


def ours(code: Any) -> bool:
    """Whether a class or function is the user's (or a library's not versioned here), not one of
    ``LIBRARIES``' or Python's own."""
    return not library_package((getattr(code, "__module__", None) or "").split(".")[0])


def library_package(package: str) -> bool:
    """Whether the top-level package ``package`` is one of ``LIBRARIES`` or Python's own."""
    return package in _VERSIONED or package in sys.stdlib_module_names
