"""Translations of the class-index losses, ``nll_loss`` and ``cross_entropy_loss``.

A negative class other than ``ignore_index`` (labels padded with -1 under the default -100) is
refused at run time, as torch raises: it becomes the class count, which onnxruntime refuses (the
call then runs eagerly and raises torch's error); ONNX's loss took it from the end.

An ``ignore_index`` that is a size (a question-answering head ignores positions past the
sequence: ``ignore_index=seq_len``) is no attribute onnxruntime's loss takes: computed here.

``label_smoothing``: torchlib's loss did not smooth as torch does (the graph was refused at
capture, and a smoothed loss never served). Ours is aten's ``cross_entropy_loss_label_smoothing``
(aten/src/ATen/native/LossNLL.cpp): ``(1 - e) * nll + e / C * smooth``, where ``smooth`` is
``-sum(log_softmax * weight)`` over the classes, 0 at ignored positions, and its mean is over the
weights of the kept targets (over their count without weights), as ``nll_loss``'s is.
"""

from __future__ import annotations

from typing import Any

from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops import nn
from onnxscript.onnx_opset import opset18 as op

from exporters.dtypes import number_like

_MEAN, _SUM = 1, 2  # torch's reduction enum (0: none)


def nll_loss(self: Any, target: Any, weight: Any = None, reduction: int = 1, ignore_index: int = -100) -> Any:
    """torchlib's nll_loss, a negative class (but ``ignore_index``) refused at run time."""
    return nn.aten_nll_loss(self, _negative_class_past_end(target, self, ignore_index), weight, reduction,
                            ignore_index)


def cross_entropy_loss(self: Any, target: Any, weight: Any = None, reduction: int = 1, ignore_index: Any = -100,
                       label_smoothing: float = 0.0) -> Any:
    """torchlib's cross_entropy_loss, a negative class (but ``ignore_index``) refused at run time;
    an ``ignore_index`` that is a size, and ``label_smoothing``, computed here (module docstring)."""
    if target.dtype is not None and target.dtype.is_integer():
        target = _negative_class_past_end(target, self, ignore_index)
    if label_smoothing and target.dtype is not None and target.dtype.is_integer():
        nll = cross_entropy_loss(self, target, weight, reduction, ignore_index)
        return _smoothed(self, target, weight, reduction, ignore_index, label_smoothing, nll)
    if isinstance(ignore_index, ir.Value) and weight is None and not label_smoothing:
        return _cross_entropy_ignoring(self, target, ignore_index, reduction)
    return nn.aten_cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)


def _smoothed(scores: Any, target: Any, weight: Any, reduction: int, ignore_index: Any, smoothing: float,
              nll: Any) -> Any:
    """``(1 - smoothing) * nll + smoothing / C * smooth`` (the module docstring)."""
    rank = len(scores.shape)
    axis = 1 if rank > 1 else 0
    log_p = op.LogSoftmax(scores, axis=axis)
    zero = number_like(0.0, scores)
    if weight is not None:
        per_class = op.Reshape(weight, op.Constant(value_ints=[1, -1] + [1] * (rank - 2))) if rank > 1 else weight
        log_p = op.Mul(log_p, per_class)
    ignore = op.CastLike(ignore_index if isinstance(ignore_index, ir.Value) else op.Constant(value_int=ignore_index),
                         target)
    kept = op.Not(op.Equal(target, ignore))
    smooth = op.Where(kept, op.Neg(op.ReduceSum(log_p, op.Constant(value_ints=[axis]), keepdims=0)), zero)
    if reduction == _MEAN:
        counted = op.Cast(kept, to=scores.dtype) if weight is None else op.Where(
            kept, op.Gather(weight, op.Where(kept, target, op.CastLike(op.Constant(value_int=0), target))), zero)
        smooth = op.Div(op.ReduceSum(smooth, keepdims=0), op.ReduceSum(counted, keepdims=0))
    elif reduction == _SUM:
        smooth = op.ReduceSum(smooth, keepdims=0)
    classes = op.CastLike(op.Shape(scores, start=axis, end=axis + 1), scores)
    share = op.Div(number_like(smoothing, scores), op.Squeeze(classes))
    return op.Add(op.Mul(number_like(1.0 - smoothing, scores), nll), op.Mul(smooth, share))


def _cross_entropy_ignoring(scores: Any, target: Any, ignore_index: Any, reduction: int) -> Any:
    """``-log_softmax(scores)[target]`` over classes (axis 1), 0 where ``target == ignore_index``;
    the mean is over the others (NaN when none is left, as in torch)."""
    ignore = op.CastLike(ignore_index, target)
    kept = op.Not(op.Equal(target, ignore))
    one = op.Constant(value_ints=[1])
    picked = op.GatherElements(op.LogSoftmax(scores, axis=1), op.Unsqueeze(op.Where(kept, target, op.CastLike(
        op.Constant(value_int=0), target)), one), axis=1)
    losses = op.Where(kept, op.Neg(op.Squeeze(picked, one)), number_like(0.0, scores))
    if reduction == 0:
        return losses
    total = op.ReduceSum(losses, keepdims=0)
    return total if reduction == 2 else op.Div(total, op.CastLike(op.ReduceSum(op.Cast(kept, to=ir.DataType.INT64),
                                                                               keepdims=0), scores))


def _negative_class_past_end(target: Any, scores: Any, ignore_index: Any) -> Any:
    """``target`` with each negative class but ``ignore_index`` replaced by the class count:
    out of range, which onnxruntime refuses (the call then runs eagerly and raises torch's error)."""
    axis = 1 if len(scores.shape) > 1 else 0
    classes = op.CastLike(op.Squeeze(op.Shape(scores, start=axis, end=axis + 1)), target)
    ignore = op.CastLike(ignore_index if isinstance(ignore_index, ir.Value) else op.Constant(value_int=ignore_index),
                         target)
    bad = op.And(op.Less(target, op.CastLike(op.Constant(value_int=0), target)), op.Not(op.Equal(target, ignore)))
    fixed = op.Where(bad, classes, target)
    fixed.shape, fixed.dtype = target.shape, target.dtype  # what torchlib's translation reads of its target
    return fixed
