"""Values a graph was not verified at: a capture is verified on its first call's values, so a graph
that is exact there and not at others (a tiny constant the optimiser dropped, a log-domain op
computed naively) would be served wrong later. Each case is captured at ordinary values, then
called at the values that broke it, against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import clika_runtime as cr


def _served(fn, ordinary, trap):
    """``fn`` compiled, captured at ``ordinary`` inputs, then called at ``trap``; asserts that a
    graph served the call and returns (served, eager)."""
    f = cr.compile(fn)
    with torch.no_grad():
        f(*ordinary)
        got = f(*trap)
        assert sum(c.hits for c in f.captures) == 1, (f.fallback_reason, f.recapture_reasons)
        return got, fn(*trap)


_ZERO = torch.zeros(2, 6)
_ORDINARY = torch.rand(2, 6) + 0.5

# onnxscript's optimiser took `x + c` for `x` when |c| <= 1e-8 and `x * c` for `x` when c is
# within 1e-5 of 1: an epsilon that keeps a log or a division finite at 0 was dropped.
SMALL_CONSTANTS = {
    "log(x + 1e-10)": lambda x: torch.log(x + 1e-10),
    "x / (|x| + 1e-8)": lambda x: x / (x.abs() + 1e-8),
    "rsqrt(mean(x^2) + 1e-12)": lambda x: torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12),
    "log(x - 1e-9 + 2e-9)": lambda x: torch.log(x - 1e-9 + 2e-9),
    "x * 1.000005": lambda x: (x + 1) * 1.000005,
    "x / 1.000005": lambda x: (x + 1) / 1.000005,
}


@pytest.mark.parametrize("name", SMALL_CONSTANTS)
def test_trap_a_tiny_constant_is_kept(name):
    got, want = _served(SMALL_CONSTANTS[name], (_ORDINARY,), (_ZERO,))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
