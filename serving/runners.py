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

    ``run`` trusts its caller's key and guard; ``server`` makes the hot path's checked run, which
    checks each tensor's dtype, device and shape itself as it binds it.
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

        self._session = session
        self._in = tuple(input_names)
        self._out = list(output_names)
        self._options = _run_options()
        self._public_options = ort.RunOptions()  # run_with_iobinding takes the public wrapper
        self._raw = _raw_run(session)
        self._from_numpy = torch.from_numpy
        self._device = torch.device("cuda", place.device_id) if place.device == "cuda" else torch.device("cpu")
        # Where eager's outputs live when they differ from the place (CUDA inputs on a CPU place).
        self._home = input_device if input_device is not None and input_device != self._device else None
        numpy_ok = all(str(d).replace("torch.", "") not in _NOT_NUMPY for d in dtypes)
        self._stream = _stream_of(place) if place.device == "cuda" else None
        # What each input must be for the graph to read it: (dtype, rank), from the session itself.
        declared = {i.name: i for i in session.get_inputs()}
        self._inputs = tuple(_declared_input(declared.get(name), torch) for name in self._in)
        self._input_device = input_device if input_device is not None else self._device
        # run(tensors in input order) -> output tensors in output order
        self.run: Callable[[Sequence[Any]], list[Any]]
        self.path: str  # which of the three ways run() takes: "dlpack", "reused binding" or "numpy"
        if place.device != "cpu" or not numpy_ok or self._home is not None:
            self.run, self.path = self._run_dlpack, "dlpack"
        elif _reused_binding_fits(session):
            self.run, self.path = self._reused_binding_path(torch), "reused binding"
        else:
            self.run, self.path = self._numpy_path(), "numpy"

    def server(self, shapes: Sequence[tuple[int, ...] | None], first: bool = False) -> Callable[..., Any]:
        """A checked run for the hot path: ``serve(*tensors)`` with the inputs as positional arguments.

        It runs the graph when every tensor has the dtype the graph declares, sits on the device
        the runner was made for, and has ``shapes[i]`` (``None``: any shape of the declared rank),
        and returns ``None`` otherwise, without running. Those are the facts that decide what
        memory onnxruntime reads, so they are checked here, once, where the tensors are bound.
        The caller checks what is its own business (exact tensor type, autograd, other guards).
        ``first``: return the first output alone instead of the list.
        """
        expect = tuple(
            (dtype, tuple(shape) if shape is not None else None, rank)
            for (dtype, rank), shape in zip(self._inputs, shapes, strict=True)
        )
        if self.path == "reused binding" and len(expect) == 1:
            return self._reused_binding_one(expect[0], first)
        run, device = self.run, self._input_device

        def serve(*tensors: Any) -> Any:
            if not _fits(tensors, expect, device):
                return None
            outs = run(tensors)  # binds each tensor with its own type, which _fits just checked
            return outs[0] if first else outs

        return serve

    def _reused_binding_path(self, torch: Any) -> Callable[[Sequence[Any]], list[Any]]:
        """Small graphs with small, fixed-shape outputs: the cheapest call onnxruntime offers.

        Each thread keeps one IOBinding (they are not thread-safe) whose outputs stay allocated
        between runs, so a run costs onnxruntime no allocation and us no dict of feeds; inputs are
        bound by pointer, and outputs copied out (cheap below ``_COPY_LIMIT``) because the next
        run writes into the same buffers.
        """
        inner, names, outputs, options = self._session._sess, self._in, self._out, self._options
        cpu = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)
        self._onnx_type = onnx_type = {getattr(torch, name): code for name, code in _BINDABLE.values()}
        from_numpy, local = torch.from_numpy, threading.local()

        def binding() -> Any:
            made = local.binding = _C.SessionIOBinding(inner)
            for name in outputs:
                made.bind_output(name, cpu)
            return made

        # The pieces the one-input checked run (_reused_binding_one) shares.
        self._binding_parts = (inner.run_with_iobinding, cpu, local, binding, from_numpy)

        def run(tensors: Sequence[Any]) -> list[Any]:
            bound = getattr(local, "binding", None) or binding()
            made = []  # dense copies: alive until the run, which reads them through bare pointers
            for name, t in zip(names, tensors):
                if not t.is_contiguous() or t.is_neg():  # a pointer means dense, plainly stored values
                    t = t.resolve_neg().contiguous()
                    made.append(t)
                # The tensor's own type: onnxruntime then rejects a mismatch instead of misreading memory.
                bound.bind_input(name, cpu, onnx_type[t.dtype], t.shape, t.data_ptr())
            inner.run_with_iobinding(bound, options)
            return list(map(from_numpy, bound.copy_outputs_to_cpu()))

        return run

    def _reused_binding_one(self, expect: tuple, first: bool) -> Callable[..., Any]:
        """``server`` for one input on the reused binding, written out: the checks and the binding
        read each tensor attribute once (each read costs ~0.1 us from Python)."""
        run_bound, cpu, local, binding, from_numpy = self._binding_parts
        options, (dtype, shape, rank) = self._options, expect
        (name,), code = self._in, self._onnx_type[dtype]

        def serve_one(t: Any) -> Any:
            dims = t.shape
            if t.dtype is not dtype or not t.is_cpu or (dims != shape if shape is not None else len(dims) != rank):
                return None
            bound = getattr(local, "binding", None) or binding()
            if not t.is_contiguous() or t.is_neg():  # a pointer means dense, plainly stored values
                t = t.resolve_neg().contiguous()
            bound.bind_input(name, cpu, code, dims, t.data_ptr())
            run_bound(bound, options)
            outs = bound.copy_outputs_to_cpu()
            return from_numpy(outs[0]) if first else list(map(from_numpy, outs))

        return serve_one

    def _numpy_path(self) -> Callable[[Sequence[Any]], list[Any]]:
        # Everything the call needs is bound to closure locals: this is the per-call hot path.
        names, outputs, options, raw, from_numpy = self._in, self._out, self._options, self._raw, self._from_numpy

        def run(tensors: Sequence[Any]) -> list[Any]:
            try:
                feed = {name: t.numpy() for name, t in zip(names, tensors)}
            except RuntimeError:  # a tensor that requires grad (served under no_grad / inference)
                feed = {name: t.detach().numpy() for name, t in zip(names, tensors)}
            return [from_numpy(a) for a in raw(outputs, feed, options)]

        return run

    def _run_dlpack(self, tensors: Sequence[Any]) -> list[Any]:
        import torch

        binding = self._session.io_binding()
        device = self._device
        for name, t in zip(self._in, tensors):
            t = t.detach()
            if t.device != device:
                t = t.to(device)
            binding.bind_ortvalue_input(name, _ortvalue_from_torch(t.contiguous()))
        ort_device = "cuda" if device.type == "cuda" else "cpu"
        for name in self._out:
            binding.bind_output(name, ort_device, device.index or 0)
        if self._stream is not None:
            current = torch.cuda.current_stream(device)
            if current.cuda_stream != self._stream:  # order onnxruntime's stream after the caller's
                torch.cuda.ExternalStream(self._stream, device=device).wait_stream(current)
        self._session.run_with_iobinding(binding, self._public_options)
        outs = [_torch_from_ortvalue(v) for v in binding.get_outputs()]
        if self._home is not None:
            outs = [o.to(self._home) for o in outs]
        return outs


# Types the reused binding binds by pointer: those numpy and torch both hold, bar complex (whose
# conjugate views a pointer cannot carry).
_BINDABLE = {
    ort: (name, code) for ort, (name, code) in ORT_TYPES.items() if name not in ("bfloat16", "complex64", "complex128")
}
# Outputs copied out of a reused binding: above this many bytes the copy costs more than the
# allocation onnxruntime saves (docs/BENCHMARKS.md).
_COPY_LIMIT = 64 * 1024


def _declared_input(meta: Any, torch: Any) -> tuple[Any, int]:
    """(torch dtype, rank) the session declares for an input; a dtype of ``None`` never fits."""
    if meta is None or meta.type not in ORT_TYPES:
        return None, -1
    return getattr(torch, ORT_TYPES[meta.type][0]), len(meta.shape)


def _fits(tensors: Sequence[Any], expect: tuple, device: Any) -> bool:
    """Whether each tensor has the expected (dtype, exact shape or None, rank) and device."""
    if len(tensors) != len(expect):
        return False
    for t, (dtype, shape, rank) in zip(tensors, expect):
        if t.dtype is not dtype or t.device != device:
            return False
        if t.shape != shape if shape is not None else t.ndim != rank:
            return False
    return True


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
        for o in session.get_outputs():
            probe.bind_output(o.name, cpu)
        return callable(probe.copy_outputs_to_cpu) and callable(session._sess.run_with_iobinding)
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
