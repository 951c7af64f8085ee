"""onnx model + place -> a session that runs it fast; loading of shipped graphs.

Imports nothing of torch at import time: a deployment box may have only onnxruntime and numpy.
"""

from serving.ort_types import DTYPE_NAMES
from serving.providers import Place, available, cuda_available, resolve
from serving.runners import NumpyRunner, TorchRunner, with_torch_stream
from serving.session import KILLED_BY_EMPTY, ProviderMissing, machine_tag, metadata, open_session

__all__ = [
    "DTYPE_NAMES",
    "KILLED_BY_EMPTY",
    "NumpyRunner",
    "Place",
    "ProviderMissing",
    "TorchRunner",
    "available",
    "cuda_available",
    "machine_tag",
    "metadata",
    "open_session",
    "resolve",
    "with_torch_stream",
]
