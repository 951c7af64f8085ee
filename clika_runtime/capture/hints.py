"""Why a capture failed, in one sentence that names the cause and the fix.

The exporter's own errors run to dozens of lines (an FX graph dump, a stack of frames); users
need the first line that matters and what to do. The exporter's message (its first lines: no
graph dumps, no stack) goes to the ``clika_runtime`` logger at DEBUG level.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from clika_runtime.base.errors import CaptureError, UncapturableError
from clika_runtime.trees.key import Unkeyable

logger = logging.getLogger("clika_runtime")

_ONNX_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
                torch.int64, torch.uint8, torch.bool}
# torch.onnx exports complex tensors as real (..., 2) pairs: a graph input or output would not
# take or give the caller's tensor.
_COMPLEX_FIX = "pass torch.view_as_real(...) and return torch.view_as_real(...) (complex tensors enter and leave graphs as real pairs)"
_OUTPUT_VALUES = (int, float, bool, str, bytes, type(None))


def check_inputs(feeds: Sequence[Any], names: Sequence[str]) -> None:
    """Inputs a graph cannot take as they are: an ``UncapturableError`` naming the input and the fix."""
    for name, feed in zip(names, feeds):
        if not isinstance(feed, torch.Tensor):
            continue
        if feed.is_complex():
            raise UncapturableError(f"input '{name}' is {feed.dtype}: {_COMPLEX_FIX}")
        if feed.layout is not torch.strided or feed.is_nested:
            raise UncapturableError(f"input '{name}' is a sparse tensor ({feed.layout}), which a graph cannot take: "
                                    "pass x.to_dense()")
        if feed.is_meta or feed.is_quantized:
            where = "on the meta device (it holds no values)" if feed.is_meta else f"quantized ({feed.dtype})"
            raise UncapturableError(f"input '{name}' is {where}, which a graph cannot take")


def check_outputs(leaves: Sequence[Any]) -> None:
    """Output leaves a graph cannot return: a clear ``CaptureError`` with the fix."""
    for pos, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_complex():
                raise UncapturableError(f"output {pos} is {leaf.dtype}: {_COMPLEX_FIX}")
            if leaf.dtype not in _ONNX_DTYPES:
                raise CaptureError(f"output {pos}: dtype {leaf.dtype} has no ONNX type")
        elif isinstance(leaf, Unkeyable):  # a KV cache the adapter refuses (kvcache.Refused): why and the fix
            raise CaptureError(f"output {pos}: {leaf}")
        elif not isinstance(leaf, _OUTPUT_VALUES):
            kind = type(leaf).__name__
            fix = (" (a key/value cache: call the model with use_cache=False, or let the decoder support serve it)"
                   if "Cache" in kind else "; return tensors, numbers or strings (or register the type as a pytree node)")
            raise CaptureError(f"output {pos} is a {kind}, which a graph cannot return{fix}")


# torch's words for the two data-dependent failures: converting a value read from a tensor to a
# Python int (a size, a slice end, a repeat count), and deciding a condition on one (a branch).
_DATA_DEPENDENT_SIZE = "extract specialized integer from data-dependent expression"
_DATA_DEPENDENT = ("data-dependent", "datadependent", "guardondatadependent")
# The assertion the exporter's decomposition fails with when the trace writes, in place, a parameter
# that two modules share (tied weights).
_SHARED_WEIGHT_WRITE = "expected compiled_fn to be graphmodule"

_DATA_DEPENDENT_SIZE_FIX = (
    "the function uses a size read from a tensor value (`x[:int(n)]`, `.item()` as a length), so the graph's "
    "shapes would depend on the data: bound the size for the exporter (`n = t.item(); torch._check(n >= 0); "
    "torch._check(n <= x.shape[0])`), use a mask instead of a slice (`x * (torch.arange(len(x)) < n)`), or run "
    "that part eagerly, outside the compiled function")
_DATA_DEPENDENT_BRANCH_FIX = (
    "the function branches on tensor values (e.g. `if x.sum() > 0:`), which one graph cannot hold: express the "
    "branch with torch.cond, or pass the condition as a static argument")
_SHARED_WEIGHT_WRITE_FIX = (
    "the function writes a weight in place that two modules share (tied weights), which the exporter cannot "
    "trace: nn.Embedding(max_norm=...) does this, it renormalises the rows it looks up in place on every "
    "forward. For export, renormalise every row once (`with torch.no_grad(): emb.weight.copy_(torch.renorm("
    "emb.weight, 2, 0, emb.max_norm))`) and set `emb.max_norm = None` (a tied head then reads every row "
    "renormalised, as it would once max_norm had looked each one up)")


def exporter_failure(error: BaseException) -> str:
    """The exporter's failure in a few lines, with the fix for the failures users meet most."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith((" ", "\t"))][:3]
    # Its first lines only: torch's graph dumps and frames are for torch's developers.
    logger.debug("the exporter failed: %s: %s", type(cause).__name__, " ".join(lines))
    summary = _first_sentences(" ".join(lines)) or type(error).__name__
    return f"{summary} -- {fix}" if (fix := _fix(text + str(cause))) else summary


def _fix(message: str) -> str | None:
    """The fix for an exporter message users meet often; ``None`` for the others."""
    lowered = message.lower()
    if _DATA_DEPENDENT_SIZE in lowered:
        return _DATA_DEPENDENT_SIZE_FIX
    if any(word in lowered for word in _DATA_DEPENDENT):
        return _DATA_DEPENDENT_BRANCH_FIX
    if _SHARED_WEIGHT_WRITE in lowered:
        return _SHARED_WEIGHT_WRITE_FIX
    return None


def _first_sentences(text: str, limit: int = 300) -> str:
    """The start of an exporter message: up to the first sentence that ends past ``limit`` // 3
    characters (torch appends advice meant for its own developers)."""
    end = text.find(". ", limit // 3)
    return (text[: end + 1] if 0 < end < limit else text[:limit]).strip()
