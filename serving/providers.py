"""``place`` -> onnxruntime providers, checked against what this onnxruntime build can give.

No torch import at module level: a deployment box may have only onnxruntime and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import onnxruntime as ort

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

# The package that brings each provider, for the error a user sees when it is missing.
_PACKAGES = {
    "CUDAExecutionProvider": "onnxruntime-gpu (pip install 'clika-runtime[cuda]')",
    "TensorrtExecutionProvider": "onnxruntime-gpu with TensorRT libraries installed",
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "DmlExecutionProvider": "onnxruntime-directml",
    "ROCMExecutionProvider": "onnxruntime-rocm",
}
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")

ProviderList = list[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Place:
    """Resolved place: the providers in priority order and the device that inputs/outputs live on."""

    providers: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    device: str  # "cpu" or "cuda"
    device_id: int

    @property
    def provider_list(self) -> ProviderList:
        """The providers in the form ``onnxruntime.InferenceSession`` takes."""
        return [(name, dict(options)) for name, options in self.providers]

    @property
    def primary(self) -> str:
        """The provider the graph is meant to run on."""
        return self.providers[0][0]


def available() -> list[str]:
    """Providers this onnxruntime build can give."""
    return list(ort.get_available_providers())


def cuda_available() -> bool:
    """Whether this onnxruntime build has the CUDA provider."""
    return CUDA in available()


def _device_from_text(text: str) -> tuple[str, int]:
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(
            f"place: expected 'cpu', 'cuda', 'cuda:N', a torch.device, a provider name or a provider list, got {text!r}"
        )
    return kind, int(index or 0)


def _normalise(place: Any, default_device: str) -> ProviderList:
    if place is None:
        place = default_device
    if type(place).__name__ == "device" and hasattr(place, "type"):  # torch.device, without importing torch
        place = place.type if place.index is None else f"{place.type}:{place.index}"
    if isinstance(place, str):
        if place.endswith("ExecutionProvider"):
            return [(place, {})]
        kind, index = _device_from_text(place)
        return [(CPU, {})] if kind == "cpu" else [(CUDA, {"device_id": index})]
    if isinstance(place, Sequence):
        providers: ProviderList = []
        for item in place:
            if isinstance(item, str):
                providers.append((item, {}))
            elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], Mapping):
                providers.append((str(item[0]), dict(item[1])))
            else:
                raise ValueError(f"place: expected provider names or (name, options) pairs, got {item!r}")
        if providers:
            return providers
    raise ValueError(f"place: expected 'cpu', 'cuda', 'cuda:N', a torch.device, a provider name or list, got {place!r}")


def resolve(place: Any, default_device: str = "cpu") -> Place:
    """Resolve ``place``; ``ValueError`` naming what is available when a provider is missing.

    ``default_device`` is used for ``place=None``: the caller passes ``"cuda"`` when the inputs are
    CUDA tensors and this build has the CUDA provider.
    """
    providers = _normalise(place, default_device)
    have = available()
    for name, _ in providers:
        if name not in have:
            brings = _PACKAGES.get(name, "an onnxruntime build that includes it")
            raise ValueError(
                f"place {place!r}: provider {name} is not available in this onnxruntime "
                f"({ort.__version__}); available: {', '.join(have)}. It comes with {brings}."
            )
    if providers[-1][0] != CPU:
        providers.append((CPU, {}))  # nodes a GPU provider lacks kernels for run on CPU, as onnxruntime intends
    first, options = providers[0]
    device, device_id = ("cuda", int(options.get("device_id", 0))) if first in _GPU_PROVIDERS else ("cpu", 0)
    frozen = tuple((name, tuple(sorted(opts.items()))) for name, opts in providers)
    return Place(frozen, device, device_id)
