"""Shipped graphs described in words, in the form ``f.captures`` lists captures in
(``capture.described``): what ``clika-runtime inspect`` prints for a saved graph. No torch:
served graphs describe their inputs with ``TensorInfo`` on boxes without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from clika_runtime.base.specs import TensorInfo
from clika_runtime.format.interface import Port, interface
from clika_runtime.guards.conditions import render
from clika_runtime.guards.guard import SHIPPED_BELOW


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
    precision: str = ""  # a reduced-precision graph's measured agreement, or why the one asked for does not serve

    def __str__(self) -> str:
        lines = [f"key: {self.key}"]
        lines += [f"  in  {i}" for i in self.inputs] + [f"  out {o}" for o in self.outputs]
        if self.guard:
            lines.append(f"  guard: {self.guard}")
        if self.precision:
            lines.append(f"  precision: {self.precision}")
        if self.hits is not None:
            lines.append(f"  hits: {self.hits}, last used {self.seconds_since_use:.1f} s ago")
        if self.phases:
            lines.append("  capture: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items()))
        return "\n".join(lines)


def describe_graph(model_proto: Any, where: str) -> CaptureInfo:
    """A saved graph in the words ``f.captures`` uses for its capture (no hits: it is a file)."""
    from clika_runtime.format import metadata

    found = metadata.read({p.key: p.value for p in model_proto.metadata_props}, where)
    declared = interface(model_proto)
    inputs, outputs = _tensor_infos(declared.inputs), _tensor_infos(declared.outputs)
    if found is None:
        return CaptureInfo(key="", inputs=inputs, outputs=outputs)
    args, kwargs = found.inputs["children"]
    leaves = [(found.parameters[i] if i < len(found.parameters) else f"args_{i}", child)
              for i, child in enumerate(args["children"])] + list(zip(map(str, kwargs["keys"]), kwargs["children"]))
    statics = [f"{path}={leaf['value']!r}" for name, child in leaves for path, leaf in _static_leaves(child, name)
               if leaf["kind"] == "const"]
    tensors = [f"{i.name}: {i.dtype}" for i in inputs]
    caches = [cache_words(name, child) for name, child in leaves if child.get("cache")]
    return CaptureInfo(key=", ".join(tensors + statics + caches), inputs=inputs, outputs=outputs,
                       guard=guard_text(found.guard) if found.guard is not None else "",
                       precision=str(found.precision) if found.precision is not None else "")


def cache_words(name: str, description: dict[str, Any]) -> str:
    """How a KV cache argument is passed to the shipped graph: a tuple of per-layer pairs, or for a
    prefill captured with an empty cache, one empty tuple per layer (``None`` or nothing also do)."""
    layers = description.get("children", ())
    kind = str(description["cache"]).rpartition(":")[2]
    if all(not layer.get("children") for layer in layers):
        empty = "(" + ", ".join("()" for _ in layers) + ("," if len(layers) == 1 else "") + ")"
        return (f"{name}={empty} (an empty {kind} of {len(layers)} layers: a prefill; "
                f"{name}=None or no {name} is taken too)")
    width = len(layers[0].get("children", ())) if layers else 2
    layer = "(key, value)" if width == 2 else "(self key, self value, cross key, cross value)"
    return f"{name}: {kind} of {len(layers)} layers, as ({layer}, ...) arrays"


def _static_leaves(description: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, leaf) of every static leaf under one argument of the captured call."""
    if description["kind"] in ("const", "static"):
        return [(path, description)]
    found = []
    for key, child in zip(description.get("keys", ()), description.get("children", ())):
        found += _static_leaves(child, f"{path}.{key}")
    return found


def _tensor_infos(ports: Sequence[Port]) -> tuple[TensorInfo, ...]:
    """Inputs or outputs with numpy's dtype names; ``KeyError`` for an element type numpy has no
    dtype for."""
    import onnx

    infos = []
    for port in ports:
        dtype = "bfloat16" if port.elem_type == onnx.TensorProto.BFLOAT16 else \
            onnx.helper.tensor_dtype_to_np_dtype(port.elem_type).name
        infos.append(TensorInfo(port.name, dtype, tuple(d if d != "" else None for d in port.dims or ())))
    return tuple(infos)


def guard_text(guard: Any) -> str:
    """What a guard adds to the dims, in words: ranges, size conditions, verified sizes 0/1."""
    # A shipped graph serves no size 0 on a dynamic dim, whatever the exporter's range says.
    parts = [f"{name} in [{max(lo, SHIPPED_BELOW)}, {'inf' if hi is None else hi}]" for name, lo, hi in guard.ranges]
    parts += [f"{render(tree, guard.names)} is {value}" for tree, value in guard.conditions]
    parts += [f"verified at {', '.join(f'{n}={s}' for n, s in point.sizes) or 'its branch'}" for point in guard.verified]
    return "; ".join(parts)
