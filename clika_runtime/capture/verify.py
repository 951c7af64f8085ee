"""Compare a new graph's outputs with the eager result of the call that captured it: within the
dtype's tolerance, or, for a reduced-precision graph, by its agreement (``base.precision``)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from clika_runtime.base.config import config
from clika_runtime.base.precision import Agreement, Measured, judged


def first_mismatch(names: Sequence[str], eager: Sequence[Any], graph: Sequence[Any], values: bool = True) -> str | None:
    """The first output that differs, in words (``None`` when all agree).

    Tensors must agree in type, dtype, shape and device, and (``values``) in value within the
    dtype's tolerance (``config.tolerances``, the absolute one times the output's largest finite
    magnitude where that is above 1; integers and bools exactly, NaN where eager has NaN); Python
    floats within float32's, other values exactly.
    """
    if len(eager) != len(graph):
        return f"graph returned {len(graph)} output leaves, eager {len(eager)}"
    for name, e, g in zip(names, eager, graph):
        problem = _compare(e, g, values)
        if problem:
            return f"output '{name}': {problem}"
    return None


def agreement_of(names: Sequence[str], eager: Sequence[Any], graph: Sequence[Any],
                 agreement: Agreement) -> tuple[list[Measured], str | None]:
    """A reduced-precision graph's outputs measured against eager's, and the first shortfall of
    ``agreement`` in words (``None``: it agrees). Call after ``first_mismatch(..., values=False)``."""
    pairs = [(n, e, g) for n, e, g in zip(names, eager, graph) if isinstance(e, torch.Tensor)]
    return judged(agreement, [n for n, _, _ in pairs], [_numpy(e) for _, e, _ in pairs], [_numpy(g) for _, _, g in pairs])


def _numpy(t: torch.Tensor) -> Any:
    t = t.detach().cpu()
    return (t.to(torch.float64) if t.is_floating_point() else t).numpy()


def _compare(e: Any, g: Any, values: bool = True) -> str | None:
    if isinstance(e, torch.Tensor):
        if not isinstance(g, torch.Tensor):
            return f"expected a tensor, got {type(g).__name__}"
        if g.dtype != e.dtype:
            return f"dtype {g.dtype}, eager {e.dtype}"
        if g.shape != e.shape:
            return f"shape {tuple(g.shape)}, eager {tuple(e.shape)}"
        if g.device != e.device:
            return f"device {g.device}, eager {e.device}"
        return _values(e.detach(), g) if values else None
    if type(g) is not type(e):
        return f"type {type(g).__name__}, eager {type(e).__name__}"
    if isinstance(e, float):  # read out of a float tensor (.item()): onnxruntime sums in another order
        rtol, atol = config.tolerance("float32")
        if math.isclose(g, e, rel_tol=rtol, abs_tol=atol) or (math.isnan(e) and math.isnan(g)):
            return None
        return f"value {g!r}, eager {e!r} (rtol={rtol}, atol={atol})"
    return None if g == e else f"value {g!r}, eager {e!r}"


def _values(e: torch.Tensor, g: torch.Tensor) -> str | None:
    if e.numel() == 0:
        return None
    if not (e.is_floating_point() or e.is_complex()):
        equal = torch.equal(e, g)
        return None if equal else f"values differ (exact match required for {e.dtype})"
    rtol, atol = config.tolerance(str(e.dtype).replace("torch.", ""))
    # Compare in float64 so float16/bfloat16 differences are measured, not rounded away.
    e64 = e if e.is_complex() else e.to(torch.float64)
    g64 = g if g.is_complex() else g.to(torch.float64)
    atol *= _size(e64)
    if torch.allclose(g64, e64, rtol=rtol, atol=atol, equal_nan=True):
        return None
    return f"values differ: {'; '.join(_differences(e64, g64, rtol, atol))} (rtol={rtol}, atol={atol})"


_LARGEST_SCALE = 16.0  # past it, the scale would excuse anything at the output's small values


def _size(e: torch.Tensor) -> float:
    """The output's largest finite magnitude, from 1 to 16: the absolute tolerance's scale.
    Round-off grows with the size of what is summed, so a value near 0 in an output whose values
    run to 8 (a Whisper's logits) differs from eager's by several times what one of unit size
    does. Capped: beside an erfcx of 2.9e9 a scale of its size accepted a graph that returned 0
    for values of 0.1."""
    finite = e.abs()[e.isfinite()]
    return min(_LARGEST_SCALE, max(1.0, finite.max().item())) if finite.numel() else 1.0


def _differences(e: torch.Tensor, g: torch.Tensor, rtol: float, atol: float) -> list[str]:
    """What differs, by kind: NaN on one side only, infinities, and the largest difference where
    both are finite. One max over everything would say "inf" for a NaN against a 0 (a fully
    masked attention row), which reads as an overflow."""
    e_nan, g_nan = e.isnan(), g.isnan()
    numbers = ~(e_nan | g_nan)
    infinite = numbers & (e.isinf() | g.isinf()) & (e != g)
    finite = numbers & e.isfinite() & g.isfinite()
    found = [
        _positions("eager has NaN", e_nan & ~g_nan, "where the graph has numbers"),
        _positions("the graph has NaN", g_nan & ~e_nan, "where eager has numbers"),
        _positions("infinities differ", infinite, ""),
    ]
    if not torch.allclose(g[finite], e[finite], rtol=rtol, atol=atol):
        worst = (g[finite] - e[finite]).abs().max().item()
        found.append(f"max abs difference {worst:.3g}" + (" where both are finite" if any(found) else ""))
    return [part for part in found if part]


def _positions(what: str, where: torch.Tensor, against: str) -> str:
    """``what`` at how many positions, and the first of them (``""`` when none)."""
    count = int(where.sum().item())
    if not count:
        return ""
    noun = "position" if count == 1 else "positions"
    text = " ".join(filter(None, [what, f"at {count} {noun}", against]))
    if where.dim() == 0:
        return text
    return f"{text}, the first at {[int(i) for i in where.nonzero()[0].tolist()]}"
