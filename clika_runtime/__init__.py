"""clika_runtime: capture a PyTorch function into ONNX on its first call, serve it through
onnxruntime, and ship the graph.

``compile`` and ``CompiledFunction`` need torch and are imported on first use, so that ``load``
serves shipped graphs on a box with only onnxruntime and numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clika_runtime.base.config import config
from clika_runtime.base.errors import (
    CaptureError,
    ClikaError,
    DeployError,
    GraphFileError,
    GraphInputError,
    GraphRunError,
    PlaceError,
    SignatureError,
    SignatureValueError,
    StateError,
    VerificationError,
)
from clika_runtime.base.precision import Agreement
from clika_runtime.base.version import VERSION as __version__
from clika_runtime.shipped.graph import ModelGraph
from clika_runtime.shipped.served import load
from clika_runtime.base.specs import DynamicAxes, PlaceLike, TensorSpec

if TYPE_CHECKING:
    from clika_runtime.function.compiled import CompiledFunction
    from clika_runtime.entry import compile

__all__ = [
    "Agreement",
    "CaptureError",
    "ClikaError",
    "CompiledFunction",
    "DeployError",
    "DynamicAxes",
    "GraphFileError",
    "GraphInputError",
    "GraphRunError",
    "ModelGraph",
    "PlaceError",
    "PlaceLike",
    "SignatureError",
    "SignatureValueError",
    "StateError",
    "TensorSpec",
    "VerificationError",
    "compile",
    "config",
    "load",
]


def __getattr__(name: str) -> Any:
    if name == "CompiledFunction":
        from clika_runtime.function.compiled import CompiledFunction

        return CompiledFunction
    if name == "compile":
        from clika_runtime.entry import compile

        return compile
    raise AttributeError(f"module 'clika_runtime' has no attribute {name!r}")
