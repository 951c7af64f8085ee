"""The HTTP side of the v2 protocol: which endpoint a request asks for, its body read within the
cap, and the error answer. Pure Python (no Ray, no web framework): unit-tested without a server.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Mapping

from clika_runtime.base.errors import ProtocolError
from clika_runtime.kserve.protocol import MODEL_VERSION, byte_count, short

BODY_TIMEOUT_S = 30.0  # how long a request's body may take to arrive


def route(method: str, path: str, model_name: str) -> str:
    """The endpoint a request asks for: ``server``, ``live``, ``ready``, ``metadata``, ``model_ready``,
    ``infer`` or ``stats``. ``path`` is relative to the application's route prefix."""
    parts = [p for p in path.split("/") if p]
    endpoint = _endpoint(parts, model_name)
    if endpoint is None:
        raise ProtocolError(f"no endpoint at {short(path)}; this server serves /v2/models/{model_name}/infer", 404)
    wanted = "POST" if endpoint == "infer" else "GET"
    if method != wanted:
        raise ProtocolError(f"{method} {short(path)}: this endpoint takes {wanted}", 405)
    return endpoint


def _endpoint(parts: list[str], model_name: str) -> str | None:
    if parts[:1] != ["v2"]:
        return None
    rest = parts[1:]
    fixed = {(): "server", ("health", "live"): "live", ("health", "ready"): "ready", ("models", "stats"): "stats"}
    if tuple(rest) in fixed:
        return fixed[tuple(rest)]
    if rest[:1] != ["models"] or len(rest) < 2:
        return None
    if rest[1] != model_name:
        raise ProtocolError(f"unknown model {short(rest[1])!r}; this server serves {model_name!r}", 404)
    tail = rest[2:]
    if tail[:1] == ["versions"]:
        if tail[1:2] != [MODEL_VERSION]:
            raise ProtocolError(f"model {model_name!r} has version {MODEL_VERSION} only", 404)
        tail = tail[2:]
    return {(): "metadata", ("ready",): "model_ready", ("infer",): "infer", ("stats",): "stats"}.get(tuple(tail))


async def read_body(
    headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit: int, timeout_s: float = BODY_TIMEOUT_S
) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``limit`` bytes: from
    ``Content-Length`` before reading anything, else while streaming, so an oversized body is never
    held whole. Compressed bodies are refused: inflating them would bypass the cap. A body not
    received within ``timeout_s`` is refused (408): a client that stalls mid-body holds one of the
    replica's request slots, and enough of them would hold every slot for good."""
    encoding = headers.get("content-encoding", "identity").lower()
    if encoding != "identity":
        raise ProtocolError(f"Content-Encoding {short(encoding)!r} is not supported: send the body uncompressed")
    declared = headers.get("content-length")
    if declared is not None and byte_count(declared, "Content-Length") > limit:
        raise ProtocolError(f"request body of {int(declared)} bytes is over the server's limit of {limit} bytes", 413)
    parts: list[bytes] = []
    try:
        await asyncio.wait_for(_collect(chunks, parts, limit), timeout_s)
    except asyncio.TimeoutError:
        expected = "" if declared is None else f" of {int(declared)}"
        raise ProtocolError(f"request body not received within {timeout_s:g} s "
                            f"({sum(map(len, parts))}{expected} bytes arrived)", 408) from None
    return b"".join(parts)


async def _collect(chunks: AsyncIterator[bytes], parts: list[bytes], limit: int) -> None:
    """Append ``chunks`` to ``parts`` (left there when the read is cut short), at most ``limit`` bytes."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"request body is over the server's limit of {limit} bytes", 413)
        parts.append(chunk)


def error_body(message: str) -> bytes:
    """The protocol's error answer: ``{"error": message}``."""
    return json.dumps({"error": message}).encode()
