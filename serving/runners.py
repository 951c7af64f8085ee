"""Run a session on tensors: numpy arrays, or torch tensors zero-copy in and out.

torch is imported lazily, inside the torch runner only: numpy serving works where torch is absent.
Fast paths use onnxruntime's private ``_sess`` / C-level OrtValue (DLPack); each has a public-API
fallback used when a future onnxruntime drops the private attribute.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import onnxruntime as ort

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
    """Runs a session on torch tensors and returns torch tensors, without copies where possible.

    CPU place and numpy-representable dtypes: tensors are viewed as numpy arrays (no copy), fed
    through the raw session run, and outputs wrapped with ``torch.from_numpy`` (no copy). Anything
    else (bfloat16, CUDA): IOBinding with DLPack OrtValues in and out, outputs bound on the place's
    device, onnxruntime working on torch's current CUDA stream.
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
        # run(tensors in input order) -> output tensors in output order
        self.run: Callable[[Sequence[Any]], list[Any]] = (
            self._numpy_path() if place.device == "cpu" and numpy_ok and self._home is None else self._run_bound
        )

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

    def _run_bound(self, tensors: Sequence[Any]) -> list[Any]:
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
