"""A fast subset of scripts/op_sweep.py: OpInfo ops compiled and called three times, against eager.

Every op here either serves from a graph with eager's values, or serves eagerly with a reason; a
compiled call that raises where eager does not, or returns another value, fails the test."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest


_SPEC = importlib.util.spec_from_file_location("op_sweep", pathlib.Path(__file__).parents[1] / "scripts" / "op_sweep.py")
op_sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(op_sweep)

# (op name, variant) -> what the sweep found: a graph serves it, or it serves eagerly (and why).
SERVED = ["abs", "add", "addcmul", "arange", "item", "clone", "cos", "diff", "div.trunc_rounding", "expand",
          "flip", "fmod", "remainder", "masked_fill", "matmul", "max.reduction_with_dim", "var_mean", "topk",
          "nn.functional.pad.constant", "nn.functional.hardtanh", "to"]
EAGER = {"cauchy": "input mutation", "copysign": "exporter failed", "view_as_complex": "complex64"}


def _op(name):
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if name in (op.name, f"{op.name}.{op.variant_test_name}"):
            return op
    pytest.skip(f"{name} is not in this torch's op_db")


@pytest.mark.parametrize("name", SERVED)
def test_op_is_served_as_eager(name):
    kind, detail = op_sweep.sweep_one(_op(name), slow=5.0, timeout=120.0)
    assert kind == op_sweep.SERVED, (kind, detail)


@pytest.mark.parametrize("name", sorted(EAGER))
def test_op_serves_eagerly_with_a_reason(name):
    kind, detail = op_sweep.sweep_one(_op(name), slow=5.0, timeout=120.0)
    assert kind == op_sweep.EAGER and EAGER[name] in detail, (kind, detail)


def test_the_comparison_tells_values_types_and_signs_apart():
    import torch

    assert op_sweep.same(torch.ones(2), torch.ones(2)) is None
    assert op_sweep.same(torch.ones(2), torch.zeros(2))
    assert op_sweep.same(torch.ones(2, dtype=torch.float64), torch.ones(2))
    assert op_sweep.same((1, 2), [1, 2]) and op_sweep.same(True, 1)
    assert op_sweep.same(float("nan"), float("nan")) is None
