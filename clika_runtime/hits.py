"""The flat hit: ``f(x, y)`` with every argument a plain tensor, checked without flattening.

Most served calls pass a few tensors positionally. For those, the general hit path's work
(optree flatten, the key tuple, its hash, the dict lookup, the guard) reduces to comparing each
argument with what the current capture's key and guard recorded: type, dtype, device, and shape
(or rank, then the guard, when some axes are dynamic). This module builds that check once per
capture, as a closure over plain data; a call it does not accept takes the general path, which
decides exactly as before, so the flat hit changes speed, never behaviour.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from clika_runtime import trees
from clika_runtime.guards import ShapeGuard

MISS = object()  # what a flat hit returns for a call it does not serve

FlatHit = Callable[[tuple], Any]


def flat_hit(
    key: tuple, owner: torch.nn.Module | None, guard: ShapeGuard, run: Callable[[Sequence[Any]], Any]
) -> FlatHit | None:
    """The flat-call check and run for a capture, or ``None`` when its key is not a flat call.

    ``key`` is the capture's cache key ``(spec, statics, metas, training)`` (``guards.key_parts``),
    ``guard`` its shape guard and ``run`` its graph run on the list of fed tensors.
    """
    spec, statics, metas, training = key
    if statics or spec != _flat_spec(len(metas)):
        return None  # kwargs, containers, Python numbers (lifted ones too): flattening needed
    count, tensor, exact = len(metas), torch.Tensor, guard.exact_shapes
    if exact is not None:  # the whole guard is one shape per input: check it in the same pass
        expected = tuple((dtype, device, shape) for (dtype, _, device, *_), shape in zip(metas, exact))

        def hit(args: tuple) -> Any:
            if len(args) != count:
                return MISS
            for a, (dtype, device, shape) in zip(args, expected):
                # Exact type: subclasses (Parameter, wrappers) and tensors needing grad go the general way.
                if type(a) is not tensor or a.dtype is not dtype or a.shape != shape or a.device != device or a.requires_grad:
                    return MISS
            if owner is not None and owner.training is not training:
                return MISS
            try:
                return run(args)
            except Exception:  # the general path runs it again and handles the failure (re-capture)
                return MISS

        return hit
    ranked = tuple((m[0], m[1], m[2], m[3] if len(m) > 3 else None) for m in metas)
    matches = guard.matches

    def hit_dynamic(args: tuple) -> Any:
        if len(args) != count:
            return MISS
        for a, (dtype, ndim, device, shape) in zip(args, ranked):
            if type(a) is not tensor or a.dtype is not dtype or a.ndim != ndim or a.device != device or a.requires_grad:
                return MISS
            if shape is not None and a.shape != shape:  # dynamic=False keys exact shapes
                return MISS
        if owner is not None and owner.training is not training or not matches(args):
            return MISS
        try:
            return run(args)
        except Exception:  # as above
            return MISS

    return hit_dynamic


def _flat_spec(count: int) -> optree.PyTreeSpec:
    """The structure of a tuple of ``count`` leaves, as the hot path's flatten builds it."""
    return trees.flatten((0,) * count)[1]
