"""The flat hit: ``f(x, None, mask)``, every argument a plain tensor or a simple constant.

Most served calls pass a few tensors, positionally or by keyword (``CallForms`` moves keywords to
their positions first). For those, the general hit path's work (optree flatten, the key tuple,
its hash, the dict lookup, the guard) reduces to comparing each argument with what the current
capture recorded: a constant's type and value, a tensor's exact type and autograd flag, the
training flag, and the guard when some axes are dynamic. The tensors' dtype, device and shape are
checked by the runner's checked run (``serving.TorchRunner.server``) where it binds them, not
here as well. This module builds the check once per capture, as a closure over
plain data; a call it does not accept takes the general path, which decides exactly as before, so
the flat hit changes speed, never behaviour.
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
    serve: Callable[..., Any],
    finish: Callable[[Any], Any] | None,
) -> FlatHit | None:
    """The flat-call check and run for a capture, or ``None`` when its key is not a flat call.

    ``key`` is the capture's cache key ``(spec, statics, metas, training)`` (``guards.key_parts``),
    ``positions`` the argument positions of its fed tensors and ``guard`` its shape guard.
    ``serve`` is the runner's checked run (``serving.TorchRunner.server``) made for the shapes
    this returns in ``shapes_for(guard)``: it checks dtype, device and shape and returns ``None``
    for tensors that do not fit. ``finish`` turns its result into the output tree (``None``: as is).
    """
    spec, statics, metas, training = key
    count = len(positions) + len(statics)
    if spec != _flat_spec(count):
        return None  # containers, or keywords that name no positional parameter
    if not all(isinstance(s, tuple) and s[0] in _CONSTANTS for s in statics):
        return None
    fed = set(positions)
    constants = [i for i in range(count) if i not in fed]
    fixed = tuple((i, kind, value) for i, (kind, value) in zip(constants, statics))
    matches = _guard_check(guard, [m[1] for m in metas])
    tensor, picks = torch.Tensor, tuple(positions)
    if not fixed and count == 1 and finish is None:
        return _one_tensor_hit(owner, training, matches, serve)

    def hit(args: tuple) -> Any:
        if len(args) != count:
            return MISS
        for i, kind, value in fixed:
            a = args[i]
            if type(a) is not kind or a != value:
                return MISS
        feeds = [args[i] for i in picks] if fixed else args
        for a in feeds:
            # Exact type: subclasses (Parameter, wrappers) and tensors needing grad go the general way.
            if type(a) is not tensor or a.requires_grad:
                return MISS
        if owner is not None and owner.training is not training:
            return MISS
        try:
            if matches is not None and not matches(feeds):
                return MISS
            out = serve(*feeds)
        except Exception:  # the general path decides again and handles the failure (re-capture)
            return MISS
        if out is None:  # a dtype, device or shape the graph was not made for
            return MISS
        return out if finish is None else finish(out)

    return hit


def shapes_for(guard: ShapeGuard) -> tuple[tuple[int, ...] | None, ...]:
    """The shapes a flat hit's ``serve`` checks: the guard's exact shapes, or ``None`` (rank only:
    the guard then checks the sizes) for every input when any axis is dynamic."""
    exact = guard.exact_shapes
    return tuple(exact) if exact is not None else (None,) * len(guard.dims)


def _guard_check(guard: ShapeGuard, ranks: Sequence[int]) -> Callable[[Sequence[Any]], bool] | None:
    """The guard, for when shapes alone do not say it all (dynamic axes, ranges, conditions); ``None``
    when the runner's checked run compares exact shapes. Ranks come first: the guard indexes axes."""
    if guard.exact_shapes is not None:
        return None
    matches, ranks = guard.matches, tuple(ranks)

    def check(feeds: Sequence[Any]) -> bool:
        for a, rank in zip(feeds, ranks):
            if a.ndim != rank:
                return False
        return matches(feeds)

    return check


def _one_tensor_hit(
    owner: torch.nn.Module | None, training: bool | None, matches: Callable | None, serve: Callable[..., Any]
) -> FlatHit:
    """``f(x)`` returning one tensor, the most common call, without the general hit's loops."""
    tensor = torch.Tensor

    def hit(args: tuple) -> Any:
        if len(args) != 1:
            return MISS
        (a,) = args
        if type(a) is not tensor or a.requires_grad or (owner is not None and owner.training is not training):
            return MISS
        try:
            if matches is not None and not matches(args):
                return MISS
            out = serve(a)
        except Exception:  # the general path decides again and handles the failure (re-capture)
            return MISS
        return MISS if out is None else out

    return hit


def _flat_spec(count: int) -> optree.PyTreeSpec:
    """The structure of a tuple of ``count`` leaves, as the hot path's flatten builds it."""
    return trees.flatten((0,) * count)[1]
