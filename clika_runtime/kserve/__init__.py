"""A KServe v2 / Triton-protocol HTTP inference server for shipped graphs, on Ray Serve.

``app(path, ...)`` builds the Ray Serve application (to run with ``serve.run`` or to compose into
your own); ``run(path, ...)`` serves it until stopped, as ``clika-runtime serve`` does. Both need
the ``serve`` extra (``pip install 'clika-runtime[serve]'``); they are imported on first use, so
the protocol and batching modules load without Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clika_runtime.kserve.deployment import app, run

__all__ = ["app", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from clika_runtime.kserve import deployment

        return getattr(deployment, name)
    raise AttributeError(f"module 'clika_runtime.kserve' has no attribute {name!r}")
