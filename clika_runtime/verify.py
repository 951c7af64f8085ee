"""Compare a new graph's outputs with the eager result of the call that captured it."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from clika_runtime.config import config


def first_mismatch(names: Sequence[str], eager: Sequence[Any], graph: Sequence[Any]) -> str | None:
    """The first output that differs, in words (``None`` when all agree).

    Tensors must agree in type, dtype, shape and device, and in value within the dtype's tolerance
    (``config.tolerances``; integers and bools exactly, NaN where eager has NaN).
    """
    if len(eager) != len(graph):
        return f"graph returned {len(graph)} output leaves, eager {len(eager)}"
    for name, e, g in zip(names, eager, graph):
        problem = _compare(e, g)
        if problem:
            return f"output '{name}': {problem}"
    return None


def _compare(e: Any, g: Any) -> str | None:
    if isinstance(e, torch.Tensor):
        if not isinstance(g, torch.Tensor):
            return f"expected a tensor, got {type(g).__name__}"
        if g.dtype != e.dtype:
            return f"dtype {g.dtype}, eager {e.dtype}"
        if g.shape != e.shape:
            return f"shape {tuple(g.shape)}, eager {tuple(e.shape)}"
        if g.device != e.device:
            return f"device {g.device}, eager {e.device}"
        return _values(e.detach(), g)
    if type(g) is not type(e):
        return f"type {type(g).__name__}, eager {type(e).__name__}"
    if isinstance(e, float) and math.isnan(e) and math.isnan(g):
        return None
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
    if torch.allclose(g64, e64, rtol=rtol, atol=atol, equal_nan=True):
        return None
    worst = (g64 - e64).abs().nan_to_num(nan=math.inf).max().item()
    return f"values differ: max abs difference {worst:.3g} (rtol={rtol}, atol={atol})"
