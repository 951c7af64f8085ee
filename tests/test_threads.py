"""Calls from several threads at once, cold and warm: right results, no deadlock."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

import clika_runtime as cr


def _fn(x, mode):
    return x * 2 if mode == "double" else x + 1


def test_concurrent_cold_and_warm_calls_are_correct():
    f = cr.compile(_fn)
    jobs = [(torch.randn(n, 3), mode) for n in (2, 2, 5, 2, 7) for mode in ("double", "inc")] * 4

    def call(job):
        x, mode = job
        with torch.no_grad():
            return f(x, mode), _fn(x, mode)

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(call, jobs, timeout=300))
    assert len(results) == len(jobs)
    for got, expected in results:
        torch.testing.assert_close(got, expected)
    assert f.state is cr.CompiledFunction.State.Compiled
