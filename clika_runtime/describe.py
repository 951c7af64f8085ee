"""Captures and shipped graphs described in words: what ``f.captures`` lists and
``clika-runtime inspect`` prints for a saved graph, in one form. No torch at module level: served
graphs describe their inputs with ``TensorInfo`` on boxes without it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from clika_runtime.capture import Capture


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


@dataclass(frozen=True)
class CaptureInfo:
    """One capture (or shipped graph) in words. ``hits`` and ``seconds_since_use`` are ``None``
    for a saved graph; ``phases`` holds how long each step of the capture took, in seconds."""

    key: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    hits: int | None = None
    seconds_since_use: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    guard: str = ""

    def __str__(self) -> str:
        lines = [f"key: {self.key}"]
        lines += [f"  in  {i}" for i in self.inputs] + [f"  out {o}" for o in self.outputs]
        if self.guard:
            lines.append(f"  guard: {self.guard}")
        if self.hits is not None:
            lines.append(f"  hits: {self.hits}, last used {self.seconds_since_use:.1f} s ago")
        if self.phases:
            lines.append("  capture: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items()))
        return "\n".join(lines)


def describe(capture: "Capture") -> CaptureInfo:
    """A cached capture in words."""
    from clika_runtime.key import Lifted  # needs torch: described captures exist only where torch is

    key = capture.key
    tensors = iter(key.tensors)
    parts = []
    for rule in capture.guard.inputs:
        if rule.shape is not None:
            dtype, _, device, *_ = next(tensors)
            parts.append(f"{rule.name}: {str(dtype).replace('torch.', '')} on {device}")
    for name, static in zip(capture.described.static_names, key.statics):
        if not isinstance(static, Lifted):
            parts.append(f"{name}={_static_text(static)}")
    if key.training is not None:
        parts.append("training" if key.training else "eval")
    return CaptureInfo(
        key=", ".join(parts),
        inputs=tuple(TensorInfo(r.name, r.dtype, r.shape if r.shape is not None else ()) for r in capture.guard.inputs),
        outputs=outputs_of(capture.model_proto),
        hits=capture.stats.hits,
        seconds_since_use=max(0.0, time.monotonic() - capture.stats.last_use),
        phases=dict(capture.stats.phases),
        guard=guard_text(capture.guard),
    )


def outputs_of(model_proto: Any) -> tuple[TensorInfo, ...]:
    """The graph outputs of an ONNX model with their dtypes and dims."""
    import onnx

    infos = []
    for value in model_proto.graph.output:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
        infos.append(TensorInfo(value.name, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
                                if tensor.elem_type != onnx.TensorProto.BFLOAT16 else "bfloat16", dims))
    return tuple(infos)


def guard_text(guard: Any) -> str:
    """What a guard adds to the dims, in words: ranges, size conditions, verified sizes 0/1."""
    from clika_runtime.guards import render

    parts = [f"{name} in [{lo}, {'inf' if hi is None else hi}]" for name, lo, hi in guard.ranges]
    parts += [f"{render(tree, guard.names)} is {value}" for tree, value in guard.conditions]
    parts += [f"verified at {', '.join(f'{n}={s}' for n, s in special.sizes)}" for special in guard.specials]
    return "; ".join(parts)


def _static_text(static: Any) -> str:
    if static[0] == "snapshot":
        return f"{static[1].__name__}(...)"
    return repr(static[1]) if len(static) == 2 else repr(static[1]) if static[1] != ("nan",) else "nan"
