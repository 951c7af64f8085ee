"""The calls an int8 graph was checked on, and the check of a wider one.

An int8 graph quantizes each activation per call with one scale for the whole tensor, so how
closely it agrees with eager depends on the call: a longer sequence or a bigger batch widens the
range one scale covers (an outlier feature meets more tokens), and one loud row coarsens every
other row's products. Its agreement was measured on the capturing call only. A later call wider
than those it was checked on (an axis more than ``GROWTH`` times as long, a float input more
than ``GROWTH`` times as large in magnitude, or its rows' loudness spread ``GROWTH`` times as far:
quiet rows beside a loud one get few of the scale's steps) is answered eagerly and the graph's answer judged
against eager's by the agreement the capture asked for, its rows' errors included
(``capture.assembly._shortfall``): agreeing, the envelope widens to that call; not, wider calls
run eagerly from then on, said once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from clika_runtime.base.precision import Agreement, magnitude
from clika_runtime.trees import pytrees as trees

GROWTH = 2.0  # how much wider than checked a call may be (a size, a magnitude) before it is checked

# Per feed: its shape, its largest magnitude, and its spread: along the axis where it is widest,
# its loudest slice's largest magnitude over its quietest (all-zero slices left out: they quantize
# exactly).
Span = tuple[tuple[int, ...], float, float]
Extent = tuple[Span, ...]


class Eagerly(Exception):
    """A call an int8 graph does not answer: one holding NaN or an infinity, which it cannot carry,
    or one wider than it was checked on. The target answers it, the graph is kept; ``judge``, when
    there is one, then weighs the graph's answer by eager's (``Envelope.checker``)."""

    def __init__(self, why: str, judge: Callable[[Any], str | None] | None = None) -> None:
        super().__init__(why)
        self.judge = judge


class Envelope:
    """The widest call a capture's int8 graph agreed with eager on. Replaced whole on each change
    (a reader in another thread sees the old bounds or the new ones)."""

    def __init__(self, feeds: Sequence[Any], names: Sequence[str], agreement: Agreement,
                 judged: Callable[[Sequence[str], list[Any], list[Any], Agreement], str | None]) -> None:
        self._bounds = extent(feeds)
        self._names, self._agreement, self._judged = list(names), agreement, judged
        self.open = True  # False once the graph disagreed: wider calls then run eagerly without it
        self.disagreed: str | None = None  # how, once it did (f.captures, take_graph() say so)

    def holds(self, spans: Extent) -> bool:
        """Whether a call of this ``extent`` is no wider than ``GROWTH`` times what was checked."""
        return all(_within(call, bound) for call, bound in zip(spans, self._bounds))

    def checker(self, spans: Extent, graph_out: Any) -> Callable[[Any], str | None]:
        """The judge of the graph's answer ``graph_out`` to a call of this ``extent`` by eager's:
        widens the envelope when they agree; else closes it and returns what to say."""

        def judge(eager_out: Any) -> str | None:
            short = self._judged(self._names, trees.flatten(eager_out)[0], trees.flatten(graph_out)[0], self._agreement)
            if short is None:
                self._bounds = tuple(_widest(a, b) for a, b in zip(self._bounds, spans))
                return None
            self.open, self.disagreed = False, short
            return (f"int8 agrees less with eager fp32 on a call wider than the one it was checked on ({short}): "
                    "calls that wide run eagerly; capture int8 on a call as wide as those it serves")

        return judge


def extent(feeds: Sequence[Any]) -> Extent:
    """Each feed's shape, largest magnitude and spread (a Python number, a lifted size: (), 0, 1)."""
    return tuple(_span(f) for f in feeds)


def _span(feed: Any) -> Span:
    shape = tuple(getattr(feed, "shape", ()))
    if len(shape) < 2 or not feed.is_floating_point() or not feed.numel():
        return shape, magnitude(feed), 1.0
    loudness = feed.abs()
    largest = float(loudness.amax())  # NaN where the feed holds one
    return shape, largest, max(_spread(loudness, axis, largest) for axis in range(len(shape)))


def _spread(loudness: torch.Tensor, axis: int, largest: float) -> float:
    """How much louder the loudest slice along ``axis`` is than the quietest non-zero one. Every
    axis is read: a [batch, tokens, features] input's quiet tokens are slices along axis 1, a
    [batch, channels, frames] input's quiet frames along axis 2, and either becomes the rows of a
    product inside the model."""
    slices = loudness.amax([a for a in range(loudness.dim()) if a != axis])
    quietest = float(torch.where(slices > 0, slices, largest).amin())  # all-zero slices quantize exactly
    return largest / quietest if quietest > 0 else 1.0


def _within(call: Span, bound: Span) -> bool:
    (shape, largest, spread), (checked, bound_largest, bound_spread) = call, bound
    return (len(shape) == len(checked) and all(n <= GROWTH * max(c, 1) for n, c in zip(shape, checked))
            and largest <= GROWTH * bound_largest and spread <= GROWTH * bound_spread)


def _widest(a: Span, b: Span) -> Span:
    return tuple(map(max, a[0], b[0])), max(a[1], b[1]), max(a[2], b[2])
