"""Declarative inputs of ``compile``: tensor specs, dynamic axes and places."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence, Union

import serving
from clika_runtime.base.errors import PlaceError

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


class TensorInfo(NamedTuple):
    """One graph input or output as the graph declares it: each axis an int (static) or the dim's
    name (dynamic; ``None`` where a graph from another tool leaves it unnamed). A Python number
    fed to the graph is a rank-0 int64."""

    name: str
    dtype: str  # numpy's name ("float32", "int64", "bool"), or "bfloat16"
    shape: tuple[int | str | None, ...]

    @property
    def dynamic(self) -> tuple[int, ...]:
        """The axes whose size may vary."""
        return tuple(a for a, d in enumerate(self.shape) if not isinstance(d, int))

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}[{', '.join(map(str, self.shape))}]"


def resolve_place(place: PlaceLike) -> serving.Place:
    """A place as onnxruntime providers; ``PlaceError`` when onnxruntime cannot give it (never
    a silent CPU fallback)."""
    try:
        return serving.resolve(place)
    except ValueError as e:
        raise PlaceError(str(e)) from e
