"""Run a session on tensors: numpy arrays, or torch tensors zero-copy in and out.

torch is imported lazily, inside the torch runner only: numpy serving works where torch is absent.
Fast paths use onnxruntime's private ``_sess`` and C-level classes (IOBinding, OrtValue with
DLPack); each has a public-API fallback used when a future onnxruntime drops them.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import numpy as np
import onnxruntime as ort

from serving.ort_types import ORT_TYPES
from serving.providers import CUDA, Place

try:  # the C-level classes carry DLPack both ways; the public wrappers only one way
    from onnxruntime.capi import _pybind_state as _C
except ImportError:  # pragma: no cover - depends on the onnxruntime build
    _C = None


def _raw_run(session: ort.InferenceSession) -> Callable[..., list[Any]]:
    """``session._sess.run`` skips per-call argument re-validation; ``session.run`` otherwise."""
    inner = getattr(session, "_sess", None)
    return inner.run if inner is not None and hasattr(inner, "run") else session.run


def _run_options() -> Any:
    return _C.RunOptions() if _C is not None else ort.RunOptions()


class NumpyRunner:
    """Feeds numpy arrays by input name, returns numpy arrays in output order."""

    def __init__(self, session: ort.InferenceSession, input_names: Sequence[str], output_names: Sequence[str]):
        self._run = _raw_run(session)
        self._in = tuple(input_names)
        self._out = list(output_names)
        self._options = _run_options()

    def run(self, arrays: Sequence[Any]) -> list[Any]:
        """Run the graph; ``arrays`` in input order."""
        return self._run(self._out, dict(zip(self._in, arrays)), self._options)


# dtypes numpy cannot hold: those go through DLPack instead of numpy.
_NOT_NUMPY = ("bfloat16", "complex32")


class TorchRunner:
    """Runs a session on torch tensors and returns fresh torch tensors, without copies where possible.

    One of three paths, chosen once per session (``path``), the fastest that fits (measured in
    ``scripts/bench_paths.py``):

    - ``"reused binding"`` (CPU, numpy-representable dtypes, outputs of fixed shape and at most
      ``_COPY_LIMIT`` bytes): inputs bound by pointer to a per-thread IOBinding, small outputs
      copied out of buffers onnxruntime keeps between runs.
    - ``"numpy"`` (other CPU graphs): tensors viewed as numpy arrays (no copy) through the raw
      session run, outputs wrapped with ``torch.from_numpy`` (no copy).
    - ``"dlpack"`` (bfloat16, CUDA): IOBinding with DLPack OrtValues in and out, outputs bound on
      the place's device, onnxruntime working on torch's current CUDA stream.

    ``run`` binds what it is given: whether a call fits the graph (dtype, device, shape) is the
    caller's guard's business. Each path is a closure over plain locals, never over the runner,
    so a runner and its session are freed as soon as nothing uses them (no reference cycle).
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        place: Place,
        input_names: Sequence[str],
        output_names: Sequence[str],
        dtypes: Sequence[Any],
        input_device: Any = None,
    ) -> None:
        """``dtypes``: every input and output dtype (torch dtypes or names such as ``"bfloat16"``):
        they decide whether the numpy path can carry them."""
        import torch

        self.session = session
        names, outputs = tuple(input_names), list(output_names)
        device = torch.device("cuda", place.device_id) if place.device == "cuda" else torch.device("cpu")
        # Where eager's outputs live when they differ from the place (CUDA inputs on a CPU place).
        home = input_device if input_device is not None and input_device != device else None
        numpy_ok = all(str(d).replace("torch.", "") not in _NOT_NUMPY for d in dtypes)
        # run(tensors in input order) -> output tensors in output order
        self.run: Callable[[Sequence[Any]], list[Any]]
        self.path: str  # which of the three ways run() takes: "dlpack", "reused binding" or "numpy"
        if place.device != "cpu" or not numpy_ok or home is not None:
            stream = _stream_of(place) if place.device == "cuda" else None
            self.run, self.path = _dlpack_path(session, names, outputs, device, home, stream), "dlpack"
        elif _reused_binding_fits(session):
            self.run, self.path = _reused_binding_path(session, names, outputs, torch), "reused binding"
        else:
            self.run, self.path = _numpy_path(session, names, outputs, torch), "numpy"


def _reused_binding_path(session: ort.InferenceSession, names: tuple, outputs: list, torch: Any) -> Callable:
    """Small graphs with small, fixed-shape outputs: the cheapest call onnxruntime offers.

    Each thread keeps one IOBinding (they are not thread-safe) whose outputs are bound once, to
    buffers of their fixed shapes, so a run costs onnxruntime no allocation and us no dict of
    feeds. Inputs are bound by pointer with the tensor's own type (onnxruntime then rejects a
    mismatch instead of misreading memory), and bound again only when the pointer, shape or dtype
    differ from what the binding holds: the same memory, read again, is the same binding (the
    tensor passed is alive while the run reads it). Outputs are copied out of the buffers (cheap
    below ``_COPY_LIMIT``): the next run writes into them, and a caller owns what it is given.
    """
    inner, options = session._sess, _run_options()
    cpu = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)
    onnx_type = {getattr(torch, name): code for name, code in _BINDABLE.values()}
    declared = {o.name: o for o in session.get_outputs()}
    kinds = [(name, *_BINDABLE[declared[name].type], list(declared[name].shape)) for name in outputs]
    from_numpy, local = torch.from_numpy, threading.local()

    def binding() -> list[Any]:
        made, buffers = _C.SessionIOBinding(inner), []
        for name, dtype, code, shape in kinds:
            buffer = np.empty(shape, dtype)
            made.bind_output(name, cpu, code, shape, buffer.ctypes.data)
            buffers.append(buffer)
        held = local.held = [made, buffers, None]  # the binding, its output buffers, what its inputs are bound to
        return held

    if len(names) == 1 and len(outputs) == 1:  # f(x) -> y: without the loops (0.3-0.5 us a call, scripts/bench_paths.py)
        (only,) = names

        def run_one(tensors: Sequence[Any]) -> list[Any]:
            held = getattr(local, "held", None) or binding()
            (t,) = tensors
            if not t.is_contiguous() or t.is_neg():  # a pointer means dense, plainly stored values
                t = t.resolve_neg().contiguous()  # kept alive by this frame until the run has read it
            bound = (t.data_ptr(), t.shape, t.dtype)
            if bound != held[2]:
                held[0].bind_input(only, cpu, onnx_type[t.dtype], t.shape, bound[0])
                held[2] = bound
            inner.run_with_iobinding(held[0], options)
            return [from_numpy(held[1][0].copy())]

        return run_one

    def run(tensors: Sequence[Any]) -> list[Any]:
        held = getattr(local, "held", None) or binding()
        dense = []  # with dense copies where needed: alive until the run, which reads them through bare pointers
        for t in tensors:
            if not t.is_contiguous() or t.is_neg():  # a pointer means dense, plainly stored values
                t = t.resolve_neg().contiguous()
            dense.append(t)
        bound = [(t.data_ptr(), t.shape, t.dtype) for t in dense]
        if bound != held[2]:
            for name, t, (pointer, _, _) in zip(names, dense, bound):
                held[0].bind_input(name, cpu, onnx_type[t.dtype], t.shape, pointer)
            held[2] = bound
        inner.run_with_iobinding(held[0], options)
        return [from_numpy(buffer.copy()) for buffer in held[1]]

    return run


def _numpy_path(session: ort.InferenceSession, names: tuple, outputs: list, torch: Any) -> Callable:
    """Tensors viewed as numpy arrays (no copy) through the raw run; outputs wrapped, not copied."""
    raw, options, from_numpy = _raw_run(session), _run_options(), torch.from_numpy

    def run(tensors: Sequence[Any]) -> list[Any]:
        try:
            feed = {name: t.numpy() for name, t in zip(names, tensors)}
        except RuntimeError:  # a tensor that requires grad (served under no_grad / inference), a negative view
            feed = {name: t.detach().resolve_neg().numpy() for name, t in zip(names, tensors)}
        return [from_numpy(a) for a in raw(outputs, feed, options)]

    return run


def _dlpack_path(
    session: ort.InferenceSession, names: tuple, outputs: list, device: Any, home: Any, stream: int | None
) -> Callable:
    """IOBinding with DLPack OrtValues: bfloat16, CUDA, and CUDA inputs served on a CPU place."""
    import torch

    options = ort.RunOptions()  # run_with_iobinding takes the public wrapper
    ort_device = "cuda" if device.type == "cuda" else "cpu"

    def run(tensors: Sequence[Any]) -> list[Any]:
        binding = session.io_binding()
        for name, t in zip(names, tensors):
            t = t.detach().resolve_neg()  # DLPack carries no negative bit: the view would be read un-negated
            if t.device != device:
                t = t.to(device)
            binding.bind_ortvalue_input(name, _ortvalue_from_torch(t.contiguous()))
        for name in outputs:
            binding.bind_output(name, ort_device, device.index or 0)
        if stream is not None:
            current = torch.cuda.current_stream(device)
            if current.cuda_stream != stream:  # order onnxruntime's stream after the caller's
                torch.cuda.ExternalStream(stream, device=device).wait_stream(current)
        session.run_with_iobinding(binding, options)
        outs = [_torch_from_ortvalue(v) for v in binding.get_outputs()]
        return [o.to(home) for o in outs] if home is not None else outs

    return run


# Types the reused binding binds by pointer: those numpy and torch both hold, bar complex (whose
# conjugate views a pointer cannot carry).
_BINDABLE = {
    ort: (name, code) for ort, (name, code) in ORT_TYPES.items() if name not in ("bfloat16", "complex64", "complex128")
}
# Outputs copied out of a reused binding: above this many bytes the copy costs more than the
# allocation onnxruntime saves (docs/BENCHMARKS.md).
_COPY_LIMIT = 64 * 1024


def _reused_binding_fits(session: ort.InferenceSession) -> bool:
    """Whether the reused-binding path fits: every input and output type is one it binds, the
    outputs have fixed shapes of at most ``_COPY_LIMIT`` bytes, and this onnxruntime's C-level
    IOBinding takes the calls the path makes (probed, so a changed private API means the numpy
    path, never a failing capture)."""
    if any(i.type not in _BINDABLE for i in session.get_inputs()):
        return False
    total = 0
    for o in session.get_outputs():
        if o.type not in _BINDABLE or not all(isinstance(d, int) for d in o.shape):
            return False
        total += np.dtype(_BINDABLE[o.type][0]).itemsize * math.prod(o.shape)
    if total > _COPY_LIMIT:
        return False
    try:
        probe = _C.SessionIOBinding(session._sess)
        cpu = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)
        for i in session.get_inputs():  # an empty tensor: nothing is read before a run
            probe.bind_input(i.name, cpu, _BINDABLE[i.type][1], [0], 0)
        for o in session.get_outputs():  # outputs bound to buffers, as the path binds them
            buffer = np.empty(o.shape, _BINDABLE[o.type][0])
            probe.bind_output(o.name, cpu, _BINDABLE[o.type][1], list(o.shape), buffer.ctypes.data)
        return callable(session._sess.run_with_iobinding)
    except (AttributeError, TypeError):
        return False


def _ortvalue_from_torch(t: Any) -> Any:
    if _C is not None and hasattr(_C.OrtValue, "from_dlpack"):
        return ort.OrtValue(_C.OrtValue.from_dlpack(t.__dlpack__()), t)  # keep t alive with the value
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def _torch_from_ortvalue(value: ort.OrtValue) -> Any:
    import torch

    inner = getattr(value, "_ortvalue", None)
    if inner is not None and hasattr(inner, "to_dlpack"):
        return torch.from_dlpack(inner.to_dlpack())
    return torch.from_numpy(value.numpy())


def _stream_of(place: Place) -> int | None:
    for name, options in place.providers:
        if name == CUDA:
            stream = dict(options).get("user_compute_stream")
            return int(stream) if stream else None
    return None


def with_torch_stream(place: Place) -> Place:
    """The place with onnxruntime's CUDA work put on torch's current stream (no device-wide sync).

    Kernels then queue behind whatever torch has queued on that stream, so inputs written by torch
    are ready; a call made under another stream is ordered with ``wait_stream`` in the runner.
    """
    if place.device != "cuda":
        return place
    import torch

    stream = torch.cuda.current_stream(place.device_id).cuda_stream
    providers = []
    for name, options in place.providers:
        opts = dict(options)
        if name == CUDA and "user_compute_stream" not in opts:
            opts.update(has_user_compute_stream="1", user_compute_stream=str(stream))
        providers.append((name, tuple(sorted(opts.items()))))
    return Place(tuple(providers), place.device, place.device_id)
