"""Property: any sequence of calls (shapes, static values, structures) gives exactly what eager gives."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import clika_runtime as cr


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
