"""Translations of the log-domain ops torch computes stably and torchlib computes naively.

``log1p`` and ``expm1`` (torchlib's ``log(x + 1)`` and ``exp(x) - 1``) lose every digit of a tiny
``x``; ours keep them (``log1p``, ``expm1`` below).

torchlib writes ``log_sigmoid`` as ``log(sigmoid(x))``, ``logaddexp`` as ``log(exp(a) + exp(b))``
and ``logcumsumexp`` as ``log(cumsum(exp(x - max(x)))) + max(x)``. Each is exact at the values a
capture is verified at and wrong at others: onnxruntime's sigmoid is 0 from x <= -18 (and 2x off
near -17), so a confidently wrong logit gave ``-inf`` where torch gives -20 (``F.logsigmoid``,
and ``binary_cross_entropy_with_logits``, which torch decomposes into it: ``inf`` where torch's
loss is 1e5); ``exp`` overflows past 88 and underflows below -104 (log-probabilities of -200 summed
to ``-inf``); a prefix far below the row's maximum underflowed to ``-inf`` in ``logcumsumexp``.

The same ``log(sigmoid(x))`` written by hand (``torch.log(torch.sigmoid(x))``) is two ops in the
graph; ``logs_of_sigmoids`` computes such a sigmoid as torch's kernel does,
``1 / (1 + exp(-x))``, a float down to x = -88 where onnxruntime's is 0.

Ours follow torch's kernels (aten/src/ATen/native/BinaryOps.cpp, Activation.cpp):
``log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|))``, ``logaddexp(a, b) = max(a, b) +
log1p(exp(-|a - b|))`` (``a`` itself where both are the same infinity), ``logaddexp2`` the same in
base 2, and ``logcumsumexp`` as a scan of ``logaddexp`` over shifted copies of the input
(Hillis-Steele: ceil(log2(n)) steps of one shift and one ``logaddexp`` each, n the axis' length;
31 steps where the length is dynamic).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.onnx_opset import opset18 as op

from exporters.dtypes import number_like

_DYNAMIC_STEPS = 31  # a dynamic axis: shifts up to 2**30, past any length a tensor axis has


def log_sigmoid(self: Any) -> Any:
    """``min(x, 0) - log1p(exp(-|x|))``: finite wherever ``x`` is."""
    return op.Sub(op.Min(self, number_like(0.0, self)), _log1p(op.Exp(op.Neg(op.Abs(self)))))


def logaddexp(self: Any, other: Any) -> Any:
    """``max(a, b) + log1p(exp(-|a - b|))``; ``a`` where both are the same infinity."""
    return _log_add(self, other, op.Exp(op.Neg(op.Abs(op.Sub(self, other)))), None)


def logaddexp2(self: Any, other: Any) -> Any:
    """``max(a, b) + log1p(2 ** -|a - b|) / ln 2``; ``a`` where both are the same infinity."""
    ln2 = number_like(math.log(2.0), self)
    return _log_add(self, other, op.Exp(op.Mul(op.Neg(op.Abs(op.Sub(self, other))), ln2)), ln2)


def logcumsumexp(self: Any, dim: int) -> Any:
    """``log(cumsum(exp(x)))`` along ``dim`` without leaving the log domain: each step adds, to
    every position, the running total that ends ``2 ** k`` positions before it."""
    rank = len(self.shape)
    if rank == 0:
        return self
    dim %= rank
    size = self.shape[dim]
    steps = max(1, math.ceil(math.log2(size))) if isinstance(size, int) and size > 1 else \
        0 if isinstance(size, int) else _DYNAMIC_STEPS
    length = op.Shape(self, start=dim, end=dim + 1)
    lowest = number_like(-math.inf, self)
    total = self
    at_dim = [0] * (2 * rank)
    at_dim[dim] = 1
    for k in range(steps):
        # 2**k positions of -inf before the axis' start, then the first `length` kept. On a dynamic
        # axis no more than `length`: padded by 2**30, one row took 4 GiB on every call.
        shift = op.Constant(value_ints=[2 ** k])
        shift = shift if isinstance(size, int) else op.Min(length, shift)
        pads = op.Mul(op.Constant(value_ints=at_dim), shift)
        shifted = op.Slice(op.Pad(total, pads, lowest), op.Constant(value_ints=[0]), length,
                           op.Constant(value_ints=[dim]))
        total = logaddexp(total, shifted)
    return total


def log1p(self: Any) -> Any:
    """``log(1 + x)`` to float rounding for tiny ``x`` (torchlib's ``log(x + 1)`` is 0 for
    |x| < 6e-8: ``n * log1p(-p)`` with p = 1e-9 and n = 1e9 gave 0, not -1); ``+inf`` stays."""
    positive_infinity = op.IsInf(self, detect_negative=0)
    return op.Where(positive_infinity, self, _log1p(self))


def expm1(self: Any) -> Any:
    """``exp(x) - 1`` to float rounding for tiny ``x`` (Kahan: ``(u - 1) * x / log(u)`` with
    ``u = exp(x)``; ``x`` where ``u`` rounds to 1, -1 where ``u - 1`` does, ``u`` where it is +inf)."""
    u = op.Exp(self)
    gap = op.Sub(u, number_like(1.0, u))
    exact = op.Div(op.Mul(gap, self), op.Log(u))
    out = op.Where(op.Equal(gap, number_like(-1.0, u)), gap, exact)
    out = op.Where(op.IsInf(u, detect_negative=0), u, out)
    return op.Where(op.Equal(u, number_like(1.0, u)), self, out)


def _log_add(a: Any, b: Any, ratio: Any, scale: Any) -> Any:
    """``max(a, b) + log1p(ratio) [/ scale]``, or ``a`` where ``a`` and ``b`` are the same infinity
    (their difference is NaN there; torch returns the infinity)."""
    tail = _log1p(ratio)
    out = op.Add(op.Max(a, b), tail if scale is None else op.Div(tail, scale))
    return op.Where(op.And(op.IsInf(a), op.Equal(a, b)), a, out)


def _log1p(u: Any) -> Any:
    """``log(1 + u)`` for finite ``u``, to float rounding also where ``u`` is below the precision
    of 1 + u (ONNX has no Log1p): ``log(w) * u / (w - 1)`` with ``w = 1 + u``, and ``u`` where
    ``w`` rounds to 1 (Goldberg, "What every computer scientist should know about floating-point
    arithmetic", theorem 4)."""
    one = number_like(1.0, u)
    w = op.Add(u, one)
    gap = op.Sub(w, one)
    return op.Where(op.Equal(gap, number_like(0.0, u)), u, op.Mul(op.Log(w), op.Div(u, gap)))


def logs_of_sigmoids(graph: ir.Graph) -> int:
    """Feed each ``Log`` of a ``Sigmoid`` in ``graph`` (its top level) the sigmoid computed as
    ``1 / (1 + exp(-x))``; the ``Sigmoid`` stays for its other uses. Returns how many."""
    count = 0
    for log in list(graph):
        sigmoid = log.inputs[0].producer() if log.op_type == "Log" and not log.domain and log.inputs else None
        if sigmoid is None or sigmoid.op_type != "Sigmoid" or sigmoid.domain or sigmoid.inputs[0].dtype is None:
            continue
        x = sigmoid.inputs[0]
        one = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(1, dtype=x.dtype.numpy())))])
        steps = [ir.Node("", "Neg", [x])]
        steps.append(ir.Node("", "Exp", [steps[-1].outputs[0]]))
        steps.append(ir.Node("", "Add", [one.outputs[0], steps[-1].outputs[0]]))
        steps.append(ir.Node("", "Reciprocal", [steps[-1].outputs[0]]))
        for step in steps[1:]:
            step.outputs[0].dtype, step.outputs[0].shape = x.dtype, x.shape
        graph.insert_before(log, [one, *steps])
        log.replace_input_with(0, steps[-1].outputs[0])
        if not sigmoid.outputs[0].uses() and not sigmoid.outputs[0].is_graph_output():
            graph.remove(sigmoid, safe=True)
        count += 1
    return count
