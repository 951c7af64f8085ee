"""Every error clika_runtime raises, and ``first_line``, how a report quotes one. Messages name the
input path, say expected vs got, and the fix."""

from __future__ import annotations


class ClikaError(Exception):
    """Base of every error raised by clika_runtime."""


class CaptureError(ClikaError):
    """A call could not be served from one verified graph (raised with ``fullgraph=True``)."""


class UncapturableError(CaptureError):
    """The target does what no graph can (writes its buffers, takes complex tensors): no retry is made."""


class EmptyKillsError(UncapturableError):
    """The graph holds a kernel onnxruntime kills the process with on an empty input, and the call
    has a size 0: such calls run eagerly (the key's other calls still capture)."""


class VerificationError(CaptureError):
    """A freshly captured graph disagreed with the eager result of the call that made it."""


class SecondSizeError(VerificationError):
    """A graph with dynamic axes agreed with eager at the call that made it, not at a second size."""


class PlaceError(ClikaError, ValueError):
    """The requested place (device / onnxruntime provider) cannot be given."""


class StateError(ClikaError, RuntimeError):
    """An operation was asked for in a lifecycle state that does not allow it."""


class SignatureError(ClikaError, TypeError):
    """A call broke the declared signature: leaf count, rank or dtype."""


class SignatureValueError(ClikaError, ValueError):
    """A call broke the declared signature: a static size, or sizes declared equal."""


class GraphInputError(ClikaError, ValueError):
    """Inputs given to a loaded graph do not fit its declared inputs."""


class GraphFileError(ClikaError, ValueError):
    """A graph file is missing, truncated, corrupt, or lacks its external data."""


class GraphRunError(ClikaError, RuntimeError):
    """onnxruntime failed running a loaded graph on inputs its guard accepted (a node's own
    check, such as an index past the end of a table); the message is onnxruntime's."""


class DeployError(ClikaError, ValueError):
    """A graph cannot be deployed as asked (e.g. a Triton repository that Triton would refuse)."""


class ServeError(ClikaError, ValueError):
    """The KServe v2 server cannot serve this graph, or was given a configuration it cannot run."""


class ProtocolError(ClikaError, ValueError):
    """A KServe v2 request the server refuses; ``status`` is the HTTP status it is answered with
    (400 malformed, 404 unknown model or path, 405 wrong method, 413 body over the cap)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def first_line(error: BaseException) -> str:
    """The first line of an error's message, at most 300 characters (its type name when it has none)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__
