"""The flat hit: ``f(x, None, mask)``, every argument a plain tensor or a simple constant.

Most served calls pass a few tensors, positionally or by keyword (``CallForms`` moves keywords to
their positions first). For those, the general hit path's work (optree flatten, the key tuple,
its hash, the dict lookup, the guard) reduces to comparing each argument with what the current
capture's key and guard recorded: a tensor's exact type, dtype, device and shape (or rank and the
guard, when some axes are dynamic); a constant's type and value. This module builds that check
once per capture, as a closure over plain data; a call it does not accept takes the general path,
which decides exactly as before, so the flat hit changes speed, never behaviour.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from clika_runtime import trees
from clika_runtime.guards import ShapeGuard

MISS = object()  # what a flat hit returns for a call it does not serve

FlatHit = Callable[[tuple], Any]

# Constants the flat hit compares with ``type(a) is kind and a == value``. Floats are left to the
# general path (NaN and -0.0 need its care), and so are lifted numbers (they feed the graph).
_CONSTANTS = (type(None), bool, int, str)


def flat_hit(
    key: tuple,
    positions: Sequence[int],
    owner: torch.nn.Module | None,
    guard: ShapeGuard,
    run: Callable[[Sequence[Any]], Any],
) -> FlatHit | None:
    """The flat-call check and run for a capture, or ``None`` when its key is not a flat call.

    ``key`` is the capture's cache key ``(spec, statics, metas, training)`` (``guards.key_parts``),
    ``positions`` the argument positions of its fed tensors, ``guard`` its shape guard and ``run``
    its graph run on the list of fed tensors.
    """
    spec, statics, metas, training = key
    count = len(positions) + len(statics)
    if spec != _flat_spec(count):
        return None  # containers, or keywords that name no positional parameter
    fed = set(positions)
    constants = [i for i in range(count) if i not in fed]
    if not all(isinstance(s, tuple) and s[0] in _CONSTANTS for s in statics):
        return None
    fixed = tuple((i, kind, value) for i, (kind, value) in zip(constants, statics))
    exact = guard.exact_shapes
    # Per fed tensor: (dtype, device, shape to equal or None, rank); the guard runs when shapes
    # alone do not say it all (dynamic axes, ranges, size conditions).
    expected = tuple(
        (m[0], m[2], exact[j] if exact is not None else (m[3] if len(m) > 3 else None), m[1])
        for j, m in enumerate(metas)
    )
    matches = None if exact is not None else guard.matches
    tensor, picks = torch.Tensor, tuple(positions)

    def hit(args: tuple) -> Any:
        if len(args) != count:
            return MISS
        if fixed:
            for i, kind, value in fixed:
                a = args[i]
                if type(a) is not kind or a != value:
                    return MISS
            feeds: Sequence[Any] = [args[i] for i in picks]
        else:
            feeds = args
        for a, (dtype, device, shape, ndim) in zip(feeds, expected):
            # Exact type: subclasses (Parameter, wrappers) and tensors needing grad go the general way.
            if type(a) is not tensor or a.dtype is not dtype or a.device != device or a.requires_grad:
                return MISS
            if shape is not None:
                if a.shape != shape:
                    return MISS
            elif a.ndim != ndim:
                return MISS
        if owner is not None and owner.training is not training:
            return MISS
        if matches is not None and not matches(feeds):
            return MISS
        try:
            return run(feeds)
        except Exception:  # the general path runs it again and handles the failure (re-capture)
            return MISS

    return hit


def _flat_spec(count: int) -> optree.PyTreeSpec:
    """The structure of a tuple of ``count`` leaves, as the hot path's flatten builds it."""
    return trees.flatten((0,) * count)[1]
