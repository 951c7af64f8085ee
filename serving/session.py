"""One onnxruntime session per graph, made with the right options and checked to run where asked."""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

import onnxruntime as ort

from serving.providers import Place

# onnxruntime kernels that kill the process (not raise) on inputs with an empty axis: Einsum
# summing over a length 0 (SIGFPE), InstanceNormalization over a length 0 (SIGSEGV). A graph
# holding one is never run on inputs with a size 0.
KILLED_BY_EMPTY = frozenset({"Einsum", "InstanceNormalization"})


def session_options(optimize: bool | None, intra_op_threads: int | None, keep_optimized: str | None = None
                    ) -> ort.SessionOptions:
    """Session options: full graph optimisation, or basic when ``optimize`` is False (debugging
    numerics), or none when ``optimize`` is None (a model onnxruntime already optimised).
    ``keep_optimized``: a path where onnxruntime writes the model as it optimised it (weights in
    ``<path>.data``), so a later session can open it without optimising again."""
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL if optimize is None else
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    if keep_optimized is not None:
        options.optimized_model_filepath = str(keep_optimized)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         f"{os.path.basename(keep_optimized)}.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        # The weights as the CPU kernels re-lay them out ("prepacking") go to the data file too: a
        # later session maps them instead of re-packing (BERT-base opens in 0.15 s instead of 0.38 s).
        options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
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
    model: bytes | str, place: Place, *, optimize: bool | None = True, intra_op_threads: int | None = None,
    keep_optimized: str | None = None,
) -> ort.InferenceSession:
    """An ``InferenceSession`` for a serialized model (or a path) on ``place``.

    Raises ``ProviderMissing`` when onnxruntime silently dropped the requested provider: a graph
    is never served on CPU when the user asked for a GPU.
    """
    session = ort.InferenceSession(
        model,
        sess_options=session_options(optimize, intra_op_threads, keep_optimized),
        providers=place.provider_list,
    )
    got = session.get_providers()
    if place.primary not in got:
        raise ProviderMissing(f"onnxruntime did not start {place.primary} (session runs on {', '.join(got)})")
    return session


def machine_tag(place: Place) -> str:
    """What an optimised model is specific to: the onnxruntime version, the provider, the CPU."""
    return f"{ort.__version__} {place.primary} {_cpu()}"


@functools.cache
def _cpu() -> str:
    """The CPU's model name. ``platform.processor()`` only where Linux's ``/proc/cpuinfo`` cannot
    say: it runs ``uname -p`` under a lock of its own, and a process forked while another thread
    waited on that lock deadlocked in the child's first capture."""
    try:
        with open("/proc/cpuinfo") as info:
            found = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:  # not Linux
        found = None
    return found or platform.processor() or platform.machine()


def metadata(session: ort.InferenceSession) -> dict[str, Any]:
    """The model's ``metadata_props`` as a dict of strings."""
    return dict(session.get_modelmeta().custom_metadata_map)
