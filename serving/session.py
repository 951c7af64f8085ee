"""One onnxruntime session per graph, made with the right options and checked to run where asked."""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

from serving.providers import Place


def session_options(optimize: bool, intra_op_threads: int | None) -> ort.SessionOptions:
    """Session options: full graph optimisation unless ``optimize`` is False (debugging numerics)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    # One graph at a time per call: inter-op parallelism only adds thread hand-offs for these graphs.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4  # errors reach the caller as exceptions; don't print them twice
    return options


class ProviderMissing(RuntimeError):
    """onnxruntime opened the session without the requested provider (it fell back silently)."""


def open_session(
    model: bytes | str, place: Place, *, optimize: bool = True, intra_op_threads: int | None = None
) -> ort.InferenceSession:
    """An ``InferenceSession`` for a serialized model (or a path) on ``place``.

    Raises ``ProviderMissing`` when onnxruntime silently dropped the requested provider: a graph
    is never served on CPU when the user asked for a GPU.
    """
    session = ort.InferenceSession(
        model,
        sess_options=session_options(optimize, intra_op_threads),
        providers=place.provider_list,
    )
    got = session.get_providers()
    if place.primary not in got:
        raise ProviderMissing(f"onnxruntime did not start {place.primary} (session runs on {', '.join(got)})")
    return session


def metadata(session: ort.InferenceSession) -> dict[str, Any]:
    """The model's ``metadata_props`` as a dict of strings."""
    return dict(session.get_modelmeta().custom_metadata_map)
