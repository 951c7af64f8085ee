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


def body_values(cls: type) -> list[str]:
    """The names in the body of ``cls`` (not its bases) that hold plain values, read as settings
    (``LIMIT = 0.5``): not dunders, not code (functions, classes, callable objects) and not
    descriptors (properties, static and class methods)."""
    return [key for key, value in vars(cls).items()
            if not key.startswith("__") and not callable(value) and not hasattr(type(value), "__get__")]


def library_package(package: str) -> bool:
    """Whether the top-level package ``package`` is one of ``LIBRARIES`` or Python's own."""
    return package in _VERSIONED or package in sys.stdlib_module_names


def code_name(code: Any) -> str:
    """A function's, class's or module's name where it is defined (``package.module.Class.method``):
    the same in every process, where its address is not."""
    qualname = getattr(code, "__qualname__", None) or getattr(code, "__name__", "")
    return f"{getattr(code, '__module__', None) or ''}.{qualname}"
