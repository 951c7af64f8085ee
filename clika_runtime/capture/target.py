"""``Target``: what a compiled function wraps and how it is captured, fixed at ``compile()``.

Also how the target is called eagerly: with the call exactly as the user made it, holding the
process-wide ``TARGETS`` shared (never an export's turn), and, for a capturing call, whether it
mutated an input in place (a graph cannot replay that).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

import serving
from clika_runtime.base.config import config
from clika_runtime.base.precision import FP32, Agreement
from clika_runtime.base.sharing import TARGETS
from clika_runtime.capture import containers
from clika_runtime.capture.plan import Options
from clika_runtime.trees.calls import CallForms

_Tensor = torch.Tensor
_FROM_TARGET = "_clika_runtime_from_target"  # marks an exception the target raised (``target_raised``)
_RAISED = threading.local()  # the same, for an exception that takes no attributes


@dataclass(frozen=True)
class Target:
    """The compiled callable and the options of its captures."""

    fn: Callable[..., Any]
    owner: torch.nn.Module | None  # the module whose weights graphs bake, if any
    forms: CallForms
    options: Options
    fullgraph: bool
    optimize: bool
    place: serving.Place | None  # None: from the inputs' device
    output_names: tuple[str, ...] | None
    graph_name: str
    name: str
    precision: str = FP32
    agreement: Agreement | None = None  # None: ``config.agreement`` when a capture is judged

    def agreement_now(self) -> Agreement:
        """The agreement a reduced-precision graph of this target must meet to serve."""
        return self.agreement if self.agreement is not None else config.agreement

    def eager(self, args: tuple, kwargs: dict) -> Any:
        """The target's own result for the call as made (never under a function's lock)."""
        with TARGETS.shared():
            try:
                return self.fn(*args, **kwargs)
            except BaseException as error:
                _mark(error)  # the call path's boundaries let it through unchanged
                raise

    def eager_checked(self, feeds: Sequence[Any], names: Sequence[str], args: tuple, kwargs: dict) -> tuple[Any, list[str]]:
        """The eager result, and the names of the fed tensors the call mutated in place."""
        before = [_before(t) if isinstance(t, _Tensor) else None for t in feeds]
        out = self.eager(args, kwargs)  # the target's own exceptions reach the caller unchanged
        return out, [n for n, t, b in zip(names, feeds, before) if b is not None and _mutated(t, b)]

    def held(self, args: tuple, kwargs: dict) -> containers.Held:
        """What the containers among a call's arguments hold, to tell after it which it wrote into."""
        return containers.Held(args, kwargs, self.forms.argument_name)

    def place_for(self, feeds: Sequence[Any]) -> serving.Place:
        """Where a capture of these feeds runs: the given place, else CUDA for CUDA inputs when
        onnxruntime has it, else CPU; on CUDA, on torch's current stream."""
        place = self.place
        if place is None:
            cuda = next((t.device for t in feeds if isinstance(t, _Tensor) and t.device.type == "cuda"), None)
            place = serving.resolve(str(cuda) if cuda is not None and serving.cuda_available() else "cpu")
        return serving.with_torch_stream(place)


def target_raised(error: BaseException) -> bool:
    """Whether ``error`` is one the target itself raised in an eager call (it reaches the caller
    unchanged, through every boundary it crosses; any other is the library's own)."""
    if getattr(error, _FROM_TARGET, False):
        return True
    raised, _RAISED.error = getattr(_RAISED, "error", None), None  # (no traceback kept past one look)
    return raised is error


def _mark(error: BaseException) -> None:
    try:
        setattr(error, _FROM_TARGET, True)
    except (AttributeError, TypeError):  # an exception class with __slots__
        _RAISED.error = error


def _before(t: torch.Tensor) -> Any:
    """What to compare after the eager call to tell whether it mutated ``t`` in place (``None``:
    nothing to compare, a sparse or meta tensor, whose capture fails on its own)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: compare their bytes instead
        if t.layout is not torch.strided or t.is_meta:
            return None
        return t.detach().clone()


def _mutated(t: torch.Tensor, before: Any) -> bool:
    if isinstance(before, int):
        return t._version != before
    return t.shape != before.shape or not torch.equal(_bytes(t), _bytes(before))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Bytes, not values: NaN != NaN would read as a mutation.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
