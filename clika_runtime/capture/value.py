"""``Capture``: a verified graph for one cache key, its guard and the closures that serve it, as
one immutable value; and the examples a capture was made from (what its guard is checked against
when a later capture may supersede it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Sequence

import torch

from clika_runtime.base.errors import GraphFileError
from clika_runtime.base.precision import Record
from clika_runtime.base.saying import say
from clika_runtime.base.specs import TensorInfo
from clika_runtime.capture import closures
from clika_runtime.capture.closures import Stats
from clika_runtime.format import metadata
from clika_runtime.guards import json_form as guards
from clika_runtime.guards.guard import Guard
from clika_runtime.shipped import graph as graph_mod
from clika_runtime.shipped.folder import GraphFolder
from clika_runtime.state.weights import Baked
from clika_runtime.trees.key import CallKey, Described


class Example(NamedTuple):
    """What the guard reads of one input of the call a capture was made from."""

    shape: tuple[int, ...] | None  # None: a lifted Python number (``value`` holds it)
    dtype: Any
    device: str
    value: Any = None

    @property
    def is_cpu(self) -> bool:
        """As ``torch.Tensor.is_cpu``."""
        return self.device == "cpu"


@dataclass(frozen=True, repr=False)
class Capture:
    """A verified graph for one cache key, the guard saying which calls it may serve, and the
    closures that serve them (``run``: fed leaves -> output tree; ``flat``: the flat hit)."""

    key: CallKey
    described: Described
    names: tuple[str, ...]
    positions: tuple[int, ...]  # canonical leaf positions of the fed leaves
    dynamic: tuple[dict[int, str | None], ...]
    guard: Guard
    example: tuple[Example, ...]
    baked: tuple[Baked, ...]
    folder: GraphFolder  # the graph's file, for take_graph() / graphs() and the disk cache
    outputs: tuple[TensorInfo, ...]  # the graph outputs
    parts: closures.Parts
    stats: Stats
    run: Callable[[Sequence[Any]], Any]
    flat: Callable[[tuple], Any] | None
    finish: Callable[[Any, tuple, dict], Any] | None = None  # a served call's KV-cache write-back (kvcache.writeback)
    precision: Record | None = None  # a reduced-precision graph serves (``folder.reduced``): what it measured
    precision_note: str | None = None  # why the precision asked for does not serve

    def __repr__(self) -> str:
        return f"<Capture {', '.join(map(str, self.guard.inputs))}>"

    def refusing(self, feeds: Sequence[Any]) -> "Capture | None":
        """This capture, its guard refusing the sizes of ``feeds`` and past them (``Guard.refusing``):
        the graph failed there. ``None`` where they are the sizes it was made at."""
        guard = self.guard.refusing(feeds)
        if guard is None:
            return None
        run, flat = closures.closures(self.parts, guard, self.key, self.positions, self.stats)
        return replace(self, guard=guard, run=run, flat=flat)

    def graph(self) -> graph_mod.ModelGraph:
        """The capture's graph to hand out: a copy, carrying its guard. At reduced precision, the graph that serves,
        with its measured agreement (int8: standard ONNX ops; fp16: onnxruntime's fused kernels
        where they applied); else the portable graph."""
        path = self.folder.model if self.precision is None else self.folder.reduced
        changed = self.folder.changed_since_stored(path)
        if changed is not None:  # from the disk cache: what runs was checked against eager, this file was not
            raise GraphFileError(f"the disk cache's copy of this graph changed since it was stored ({changed}): "
                                 "clear the cache (clika-runtime cache clear), then reset() and capture again")
        graph = graph_mod.ModelGraph.load(path, verify_digest=False)  # our own file: no digest
        entries: dict[str, Any] = {metadata.META_GUARD: guards.to_json(self.guard)}
        if self.precision is not None:
            entries[metadata.META_PRECISION] = self.precision.to_json()
        metadata.attach(graph.model_proto, entries)
        if self.precision_note is not None:  # said at capture; the file itself does not say it
            say(f"clika_runtime: take_graph() hands out the fp32 graph: {self.precision_note}", 3)
        envelope = self.parts.envelope
        if envelope is not None and envelope.disagreed:  # what the function learned the file cannot carry
            say(f"clika_runtime: the {self.precision.precision} graph handed out disagreed with eager fp32 on a call "
                f"wider than it was checked on ({envelope.disagreed}); the function ran such calls eagerly, but "
                "cr.load serves such calls unchecked: capture it on a call as wide as those it will serve", 3)
        return graph


def examples(feeds: Sequence[Any]) -> tuple[Example, ...]:
    """What the guard reads of each fed leaf, kept without the tensors themselves."""
    return tuple(
        Example(tuple(f.shape), f.dtype, str(f.device)) if isinstance(f, torch.Tensor) else Example(None, type(f), "cpu", f)
        for f in feeds
    )
