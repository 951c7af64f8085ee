"""Calls made inside something that changes what torch computes or records: a user's
TorchFunctionMode or TorchDispatchMode, a tensor subclass, ``torch.jit.trace``, ``torch.func``
transforms, an outer ``torch.export``. A graph computes none of that: such calls run the target
eagerly, are never captured, and leave the function's graphs serving the plain calls."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import clika_runtime as cr


class _DoubleLinear(TorchFunctionMode):  # a user's fake-quant, scaling or debug mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


class _DoubleRelu(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.ops.aten.relu.default else out


class _Scaled(torch.Tensor):  # a subclass that changes what linear computes
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 10 if func is torch.nn.functional.linear else out


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()


def _hits(f):
    return sum(c.hits for c in f.captures)


def _warm(model):
    """``model``, its compiled function captured and served once at ``x``, and ``x``."""
    f, x = cr.compile(model), torch.randn(2, 4)
    with torch.no_grad():
        f(x), f(x)
    return model, f, x


@pytest.mark.parametrize("mode", [_DoubleLinear, _DoubleRelu])
@pytest.mark.parametrize("first", [True, False], ids=["the first call", "a served call"])
def test_trap_a_mode_applies_to_the_calls_under_it_only(mode, first):
    """A served call under a mode ignored it; a first call under one baked it into the graph."""
    model = _model()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    under = [True, False, False] if first else [False, False, True, False]
    with torch.no_grad():
        for moded in under:
            with mode() if moded else contextlib.nullcontext():
                torch.testing.assert_close(f(x), model(x))
    assert _hits(f) == under.count(False) - 1  # every plain call but the one that captured


def test_trap_a_tensor_subclass_input_runs_its_torch_function():
    model, f, x = _warm(_model())
    with torch.no_grad():
        scaled = x.as_subclass(_Scaled)
        got, want = f(scaled), model(scaled)
        assert type(got) is type(want) is _Scaled
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
        torch.testing.assert_close(f(x), model(x))
    assert _hits(f) == 2


def test_trap_vmap_over_a_compiled_function_leaves_it_serving():
    model = _model()
    f = cr.compile(model)
    x = torch.randn(3, 2, 4)
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(f)(x), torch.func.vmap(model)(x))
        for _ in range(2):
            torch.testing.assert_close(f(x[0]), model(x[0]))
    assert f.fallback_reason is None and _hits(f) == 1


class _Outer(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2 + 1


def test_trap_an_outer_export_traces_through_a_compiled_function():
    model, f, x = _warm(_model())
    with torch.no_grad():
        program = torch.export.export(_Outer(f), (x,))
        torch.testing.assert_close(program.module()(x), model(x) * 2 + 1)
        torch.testing.assert_close(f(x), model(x))
    assert f.fallback_reason is None and _hits(f) == 2


def test_trap_jit_trace_through_a_served_function_records_its_ops():
    model, f, x = _warm(_model().requires_grad_(False))  # eager's trace takes such weights as constants
    with torch.no_grad():
        traced = torch.jit.trace(_Outer(f), (x,), check_trace=False)
        other = torch.randn(2, 4)
        torch.testing.assert_close(traced(other), model(other) * 2 + 1)


_JIT_COLD = """
import torch, clika_runtime as cr
backbone = cr.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval())  # requires grad


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(backbone(x))


try:
    with torch.no_grad():
        torch.jit.trace(Net().eval(), (torch.randn(3, 4),))
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
"""


def test_trap_jit_trace_through_a_cold_function_raises_as_eager_instead_of_crashing(tmp_path):
    """torch.jit.trace of weights that require grad raises in eager ("Cannot insert a Tensor that
    requires grad as a constant"); through a compiled function the process died (SIGSEGV)."""
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _JIT_COLD], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: Cannot insert a Tensor that requires grad as a constant" in done.stdout, done.stdout
