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
        outputs=capture.outputs,
        hits=capture.stats.hits,
        seconds_since_use=max(0.0, time.monotonic() - capture.stats.last_use),
        phases=dict(capture.stats.phases),
        guard=guard_text(capture.guard),
    )


def describe_graph(model_proto: Any, where: str) -> CaptureInfo:
    """A saved graph in the words ``f.captures`` uses for its capture (no hits: it is a file)."""
    from clika_runtime import metadata

    found = metadata.read({p.key: p.value for p in model_proto.metadata_props}, where)
    initializers = {i.name for i in model_proto.graph.initializer}
    inputs = tuple(info for info in _values(model_proto.graph.input) if info.name not in initializers)
    if found is None:
        return CaptureInfo(key="", inputs=inputs, outputs=outputs_of(model_proto))
    args, kwargs = found.inputs["children"]
    leaves = [(found.parameters[i] if i < len(found.parameters) else f"args_{i}", child)
              for i, child in enumerate(args["children"])] + list(zip(map(str, kwargs["keys"]), kwargs["children"]))
    statics = [f"{path}={leaf['value']!r}" for name, child in leaves for path, leaf in _static_leaves(child, name)
               if leaf["kind"] == "const"]
    tensors = [f"{i.name}: {i.dtype}" for i in inputs]
    return CaptureInfo(key=", ".join(tensors + statics), inputs=inputs, outputs=outputs_of(model_proto),
                       guard=guard_text(found.guard) if found.guard is not None else "")


def _static_leaves(description: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, leaf) of every static leaf under one argument of the captured call."""
    if description["kind"] in ("const", "static"):
        return [(path, description)]
    found = []
    for key, child in zip(description.get("keys", ()), description.get("children", ())):
        found += _static_leaves(child, f"{path}.{key}")
    return found


def _values(values: Any) -> list[TensorInfo]:
    import onnx

    infos = []
    for value in values:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
        dtype = "bfloat16" if tensor.elem_type == onnx.TensorProto.BFLOAT16 else \
            onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        infos.append(TensorInfo(value.name, dtype, dims))
    return infos


def outputs_of(model_proto: Any) -> tuple[TensorInfo, ...]:
    """The graph outputs of an ONNX model with their dtypes and dims."""
    return tuple(_values(model_proto.graph.output))


def guard_text(guard: Any) -> str:
    """What a guard adds to the dims, in words: ranges, size conditions, verified sizes 0/1."""
    from clika_runtime.guards import render

    parts = [f"{name} in [{lo}, {'inf' if hi is None else hi}]" for name, lo, hi in guard.ranges]
    parts += [f"{render(tree, guard.names)} is {value}" for tree, value in guard.conditions]
    parts += [f"verified at {', '.join(f'{n}={s}' for n, s in point.sizes) or 'its branch'}" for point in guard.verified]
    return "; ".join(parts)


def _static_text(static: Any) -> str:
    if static[0] == "snapshot":
        return f"{static[1].__name__}(...)"
    return repr(static[1]) if len(static) == 2 else repr(static[1]) if static[1] != ("nan",) else "nan"
