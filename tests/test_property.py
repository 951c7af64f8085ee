"""Property: any sequence of calls (shapes, static values, structures) gives exactly what eager gives."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import clika_runtime as cr
from clika_runtime.guards.guard import Guard, InputRule, Verified


def _target(x, mode, extra=None):
    y = x.cumsum(-1) if mode == "cumsum" else x.softmax(-1)
    return {"y": y if extra is None else y + extra.mean(), "rows": x.shape[0]}


calls = st.lists(
    st.tuples(
        st.integers(1, 4),  # rows
        st.sampled_from([3, 6]),  # columns
        st.sampled_from(["cumsum", "softmax"]),
        st.booleans(),  # pass extra
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls)
def test_any_call_sequence_matches_eager(sequence):
    f = cr.compile(_target)
    for rows, cols, mode, with_extra in sequence:
        x = torch.randn(rows, cols)
        kwargs = {"extra": torch.randn(cols)} if with_extra else {}
        with torch.no_grad():
            got, expected = f(x, mode, **kwargs), _target(x, mode, **kwargs)
        assert got["rows"] == expected["rows"]
        torch.testing.assert_close(got["y"], expected["y"])
    assert f.state in (cr.CompiledFunction.State.Compiled, cr.CompiledFunction.State.Fallback)


# A decoder step's guard: dims shared across inputs, a range, a size condition, sizes 0/1 to verify, one verified point.
_STEP_GUARD = Guard(
    inputs=(InputRule("ids", "int64", ("batch", 1)), InputRule("mask", "int64", ("batch", "total")),
            InputRule("past", "float32", ("batch", 2, "past", 4))),
    ranges=(("past", 1, 63), ("total", 2, 64)),
    conditions=((("eq", ("size", 1, 1), ("add", ("size", 2, 2), ("const", 1))), True),),
    verified=(Verified((("batch", 1),), (True,)),),
    device="cpu", verify_small=True,
)


def test_the_guard_decides_a_dynamic_call_as_its_walk_does():
    """The guard's fast decision for dynamic dims (``guard._dynamic_fits``) is the walk's: it
    accepts exactly the calls ``check`` finds no mismatch in, verified points included (every
    combination of sizes around the ranges, dtypes, and torch or numpy feeds)."""
    sizes = itertools.product([0, 1, 2, 3], [1, 2], [0, 1, 2, 5, 63, 64], [0, 1, 2, 6, 64, 65], [4, 3])
    kinds = itertools.product([torch.int64, torch.int32], [torch.float32, torch.float64], [False, True])
    accepted = 0
    for (batch, step, past, total, width), (mask_dtype, past_dtype, numpy) in itertools.product(sizes, list(kinds)):
        feeds = [torch.zeros(batch, step, dtype=torch.int64), torch.zeros(batch, total, dtype=mask_dtype),
                 torch.zeros(batch, 2, past, width, dtype=past_dtype)]
        if numpy:
            feeds = [t.numpy() for t in feeds]
        fits = _STEP_GUARD.fits(feeds)
        assert fits == (_STEP_GUARD.check(feeds) is None), (feeds[0].shape, feeds[1].shape, feeds[2].shape)
        accepted += fits
    assert accepted > 0
