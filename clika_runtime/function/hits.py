"""The general hit: a call no flat hit served, flattened, keyed, looked up and guarded. It
decides exactly what the miss path would decide for a call it serves; whatever it declines goes
to the miss path. The closures a capture serves with are in ``capture.closures``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from clika_runtime.capture.closures import MISS, NO_LIFT, RunFailed
from clika_runtime.capture.envelope import Eagerly
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.key import CallKey, Unkeyable, split

if TYPE_CHECKING:
    from clika_runtime.function.table import CacheTable

_grad_enabled = torch.is_grad_enabled


def general(table: "CacheTable", args: tuple, kwargs: dict, with_shapes: bool, owner: torch.nn.Module | None) -> Any:
    """The hit for any call: flatten, key, lookup, guard, run. ``MISS`` when no capture serves it;
    raises ``RunFailed`` when a graph fails on inputs its guard accepted, ``Eagerly`` for a call
    an int8 graph does not answer (``capture.envelope``)."""
    leaves, spec = trees.flatten((args, kwargs))
    lifted = table.knowledge.lifted.get(spec, NO_LIFT) if table.knowledge.lifted else NO_LIFT
    try:
        feeds, statics, metas, grad, tensor_at = split(leaves, lifted, with_shapes)
        training = owner.training if owner is not None else None
        variants = table.entries.get(CallKey(spec, statics, metas, training, tensor_at))
    except (Unkeyable, TypeError):  # a static leaf that cannot key a capture: the miss path explains it
        return MISS
    if variants is None or (grad and _grad_enabled()):
        return MISS
    for capture in variants:  # almost always one; more when the trace branched on sizes
        if capture.guard.fits(feeds):
            try:
                out = capture.run(feeds)
            except Eagerly:  # answered by the target: not the graph's failure
                raise
            except Exception as error:
                raise RunFailed(capture, error, feeds) from error
            finish = capture.finish  # a KV cache the call passed, updated in place (kvcache.writeback)
            return out if finish is None else finish(out, args, kwargs)
    return MISS
