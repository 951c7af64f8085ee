"""Declarative inputs of ``compile``: tensor specs, dynamic axes and places."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

DimSpec = Union[int, str, None]
"""One entry of a ``TensorSpec`` shape: an int is static, ``None`` or a str is dynamic (a str names it)."""

DynamicAxes = Mapping[str, Union[Mapping[int, str], Sequence[int]]]
"""torch.onnx.export's form: ``{input_or_output_name: {axis: "dim_name"}}`` or ``{name: [axes]}``."""

PlaceLike = Union[None, str, Any, Sequence[Union[str, tuple[str, Mapping[str, Any]]]]]
"""Where graphs run: ``None`` (auto), ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, a
provider name such as ``"CUDAExecutionProvider"``, or an onnxruntime provider list with options."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor leaf of a declared signature.

    Args:
        shape: one entry per axis: an int is static, ``None`` or a str is dynamic from the first
            capture; a str names the dim in the graph, and equal names mean equal sizes.
        dtype: the expected ``torch.dtype`` (``None`` accepts any).
        name: the graph input name (default: from the parameter name and pytree path).
    """

    shape: Sequence[DimSpec]
    dtype: Any = None
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        for axis, dim in enumerate(self.shape):
            if dim is not None and not isinstance(dim, (int, str)) or isinstance(dim, bool):
                raise TypeError(f"TensorSpec shape axis {axis}: expected int, str or None, got {dim!r}")
