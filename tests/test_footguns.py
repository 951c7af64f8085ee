"""The silent traps of tracing compilers, one test each (after tinygrad's test_jit_footguns).

- Python constants are frozen at capture: a changed static value must re-capture, never be served stale.
- Data-dependent branches are frozen by tracers: every branch must still give the right result.
- In-place mutation of an input cannot be replayed by a graph: such calls are not captured.
- An int output computed from a dynamic size must be the live size, not the capture-time constant.
- The exporter may upcast (a float16 reduction exported as float32): outputs keep eager's dtypes.
- Outputs that alias inputs or each other come back as values.
- Grad: graphs serve inference; a call that is differentiating stays eager.
- A module's training flag changes what it computes: it is part of the key.
- A graph that disagrees with eager is never served.
"""

from __future__ import annotations

import pytest
import torch

import clika_runtime as cr
from clika_runtime import CaptureError
from conftest import Counted, current

State = cr.CompiledFunction.State


def test_python_constants_are_part_of_the_key_not_frozen():
    f = cr.compile(lambda x, scale: x * scale, specialize=True)
    x = torch.ones(3)
    torch.testing.assert_close(f(x, 2.0), x * 2)
    torch.testing.assert_close(f(x, 3.0), x * 3)
    torch.testing.assert_close(f(x, 2.0), x * 2)
    assert f.recapture_count == 1


def _branchy(x):
    if x.sum() > 0:
        return x * 2
    return x - 100


def test_data_dependent_branch_with_fullgraph_raises_capture_error_with_reason():
    f = cr.compile(_branchy, fullgraph=True)
    with pytest.raises(CaptureError, match="exporter failed") as info:
        f(torch.ones(3))
    assert "data" in str(info.value).lower() or "guard" in str(info.value).lower()


def test_data_dependent_branch_without_fullgraph_is_right_for_every_branch():
    f = cr.compile(_branchy)
    with pytest.warns(UserWarning, match="capture failed"):
        torch.testing.assert_close(f(torch.ones(3)), torch.ones(3) * 2)
    assert f.state is State.Fallback and f.fallback_reason.startswith("capture failed: the exporter failed")
    torch.testing.assert_close(f(-torch.ones(3)), -torch.ones(3) - 100)
    torch.testing.assert_close(f(torch.ones(3)), torch.ones(3) * 2)


def test_input_mutation_is_not_captured_and_the_input_is_mutated_as_eager_leaves_it():
    def bump(x):
        x.add_(1)
        return x * 2

    f = cr.compile(bump)
    x = torch.zeros(3)
    with pytest.warns(UserWarning, match="input mutation.*'x'"):
        out = f(x)
    torch.testing.assert_close(x, torch.ones(3))  # mutated exactly once
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    assert f.state is State.Fallback
    out = f(x)
    torch.testing.assert_close(x, torch.full((3,), 2.0))
    with pytest.raises(CaptureError, match="input mutation"):
        cr.compile(bump, fullgraph=True)(torch.zeros(3))


def test_int_output_from_a_dynamic_size_is_the_live_size():
    target = Counted(lambda x: (x.sum(0), x.shape[0]))
    f = cr.compile(target, dynamic=True)
    assert f(torch.ones(4, 2))[1] == 4
    calls = target.calls
    total, n = f(torch.ones(9, 2))
    assert target.calls == calls  # served by the graph
    assert n == 9 and type(n) is int
    torch.testing.assert_close(total, torch.full((2,), 9.0))


def test_float16_reduction_keeps_eager_dtype():
    f = cr.compile(lambda x: (x.sum(-1), x.mean(), x.to(torch.float16).softmax(-1)))
    x = torch.randn(4, 16, dtype=torch.float16)
    eager = f(x)
    served = f(torch.randn(4, 16, dtype=torch.float16))
    assert [t.dtype for t in served] == [t.dtype for t in eager] == [torch.float16] * 3
    assert f.state is State.Compiled


def test_outputs_aliasing_inputs_and_each_other_come_back_as_values():
    target = Counted(lambda x, y: (x, y * 2, x))
    f = cr.compile(target)
    f(torch.zeros(2), torch.zeros(2))
    calls = target.calls
    x, y = torch.randn(2), torch.randn(2)
    a, b, c = f(x, y)
    assert target.calls == calls
    torch.testing.assert_close(a, x)
    torch.testing.assert_close(b, y * 2)
    torch.testing.assert_close(c, x)
    a.add_(1)  # a value of its own: neither the input nor the other output moves
    torch.testing.assert_close(c, x)
    assert not torch.equal(a, x)


def test_grad_mode_with_an_input_requiring_grad_stays_eager():
    weight = torch.nn.Parameter(torch.ones(3))
    f = cr.compile(lambda x: (x * weight).sum())
    with torch.no_grad():
        f(torch.ones(3))
    assert f.state is State.Compiled
    x = torch.ones(3, requires_grad=True)
    out = f(x)
    out.backward()  # eager: autograd works
    torch.testing.assert_close(x.grad, torch.ones(3))
    with torch.no_grad():
        served = f(torch.full((3,), 2.0))
    assert not served.requires_grad and f.recapture_count == 0


class _TrainDoubles(torch.nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


def test_training_flag_is_part_of_the_key():
    model = _TrainDoubles().eval()
    f = cr.compile(model)
    x = torch.ones(2, 4)
    torch.testing.assert_close(f(x), x)
    model.train()
    torch.testing.assert_close(f(x), x * 2)
    torch.testing.assert_close(f(x), x * 2)
    model.eval()
    torch.testing.assert_close(f(x), x)
    assert f.recapture_reasons == ["module training flag changed: False -> True"]
    assert f.state is State.Compiled


def test_a_graph_that_disagrees_with_eager_is_never_served():
    # Random numbers drawn by the graph differ from eager's draw: verification must refuse it.
    f = cr.compile(lambda x: x + torch.rand_like(x))
    x = torch.zeros(1000)
    with pytest.warns(UserWarning, match="disagrees with eager: output 'output': values differ"):
        first = f(x)
    assert f.state is State.Fallback
    assert not torch.equal(f(x), first)  # eager each time: fresh draws, as the user wrote it


def test_branches_on_dynamic_sizes_are_rechecked_on_every_call():
    def by_rows(x):  # the exporter takes one branch and leaves no check behind in the graph
        return x.sum(0) if x.shape[0] == 4 else x.mean(0)

    f = cr.compile(by_rows)
    f(torch.ones(4, 3))
    f(torch.ones(5, 3))  # drift: axis 0 dynamic, traced through the mean branch
    dynamic = current(f)
    assert "x.shape[0] == 4 is False" in str(f.captures[-1]), f.captures
    assert dynamic.guard.check([torch.ones(4, 3)]).kind == "condition"  # the flip is seen ...
    for rows in (6, 4, 7, 4):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(f(x), by_rows(x))  # ... and 4 rows keep their own graph
    assert f.recapture_count == 1 and len(f.captures) == 2


def test_a_graph_failing_on_inputs_its_guard_accepts_gives_eagers_error_then_recaptures():
    table = torch.nn.Embedding(10, 4).eval()
    f = cr.compile(table)
    with torch.no_grad():
        f(torch.tensor([1, 2]))
        with pytest.raises(IndexError):  # onnxruntime fails on the bad index; eager says why
            f(torch.tensor([1, 12]))
        torch.testing.assert_close(f(torch.tensor([3, 4])), table(torch.tensor([3, 4])))
    assert f.recapture_reasons[0].startswith("the graph failed on these inputs")
    assert f.state is State.Compiled


def test_calls_under_inference_mode_capture_and_inference_tensor_mutation_is_caught():
    f = cr.compile(lambda x: x.softmax(-1))
    with torch.inference_mode():
        f(torch.randn(2, 4))
        x = torch.randn(2, 4)
        torch.testing.assert_close(f(x), x.softmax(-1))
    assert f.state is State.Compiled

    def bump(x):
        x.add_(1)
        return x * 2

    g = cr.compile(bump)
    with torch.inference_mode():
        x = torch.zeros(3)
        with pytest.warns(UserWarning, match="input mutation"):
            g(x)
    torch.testing.assert_close(x, torch.ones(3))
    assert g.state is State.Fallback


def test_calls_alternating_across_a_size_branch_stop_recapturing():
    target = Counted(lambda x: x.sum(0) * 2 if x.shape[0] == 1 else x.mean(0))
    f = cr.compile(target)
    f(torch.ones(3, 2))
    f(torch.ones(5, 2))  # axis 0 dynamic, traced through the mean branch
    f(torch.ones(1, 2))  # the branch flips: a second graph for this key
    count, calls = f.recapture_count, target.calls
    for rows in (1, 7, 1, 4, 1):
        x = torch.randn(rows, 2)
        torch.testing.assert_close(f(x), x.sum(0) * 2 if rows == 1 else x.mean(0))
    assert f.recapture_count == count == 2 and target.calls == calls
