"""No call through a compiled function raises where the eager call does not: an exception of the
library's own code ends in the eager result with a warning that names what failed and where (a
bug to report), ``fullgraph=True`` raises ``CaptureError`` with the cause chained, and the
target's own exceptions reach the caller unchanged. The faults are injected where nothing else
could make them happen (our own code working as meant)."""

from __future__ import annotations

import warnings

import pytest
import torch

import clika_runtime as cr
from clika_runtime.capture import plan
from clika_runtime.function import hits, lifecycle
from conftest import Counted

BUG = r"this is a bug in clika_runtime: please report it with this message"


class Fault(Exception):
    """What a bug in the library would raise."""


def _fault(*args, **kwargs):
    raise Fault("an internal step broke")


def _scale(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
    return x * k


def test_a_fault_while_planning_serves_the_call_eagerly_once(monkeypatch):
    monkeypatch.setattr(plan, "split", _fault)  # Call() keys the call with it
    target = Counted(_scale)
    f = cr.compile(target)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"failed planning this call \(Fault: an internal step "
                                                         r"broke, in clika_runtime/capture/plan\.py:\d+ __init__\); " + BUG):
        torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    assert target.calls == 1


def test_a_fault_after_the_eager_run_returns_its_result_without_running_the_target_again(monkeypatch):
    monkeypatch.setattr(lifecycle, "planned", _fault)
    target = Counted(_scale)
    f = cr.compile(target)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"failed capturing this call \(Fault: .*function/lifecycle"):
        torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    assert target.calls == 1
    with torch.no_grad():  # its key serves eagerly from now on, quietly
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    assert target.calls == 2 and f.eager_keys


def test_a_fault_on_the_hit_path_serves_the_call_eagerly(monkeypatch):
    target = Counted(_scale)
    f = cr.compile(target)
    with torch.no_grad():
        f(torch.ones(3), k=3.0)  # a float: the general hit serves the next such calls
        f(torch.ones(3), k=3.0)
        monkeypatch.setattr(hits, "split", _fault)
        with pytest.warns(UserWarning, match=r"failed serving this call \(Fault: .*function/hits\.py"):
            torch.testing.assert_close(f(torch.ones(3), k=3.0), torch.full((3,), 3.0))
    assert target.calls == 2 + 1  # the capture (eager and trace), then this call eagerly


def test_under_fullgraph_a_fault_is_a_capture_error_with_its_cause(monkeypatch):
    monkeypatch.setattr(lifecycle, "planned", _fault)
    f = cr.compile(_scale, fullgraph=True)
    with torch.no_grad(), pytest.raises(cr.CaptureError, match="failed capturing this call") as caught:
        f(torch.ones(3))
    assert isinstance(caught.value.__cause__, Fault)


def test_the_targets_own_exception_reaches_the_caller_unchanged():
    def picky(x):
        if x.shape[0] > 2:
            raise ValueError("at most two rows")
        return x + 1

    f = cr.compile(picky)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing is said about it
        f(torch.ones(2))
        f(torch.ones(2))
        with pytest.raises(ValueError, match="^at most two rows$"):
            f(torch.ones(5))
    assert f.state is cr.CompiledFunction.State.Compiled and f.captures[0].hits == 1


def test_the_targets_own_exception_raised_while_re_capturing_after_a_graph_failure_passes_unchanged():
    # The graph fails on an index past the end (onnxruntime); the miss re-captures from that call,
    # whose eager run raises torch's error: through two boundaries, it is still the target's.
    f = cr.compile(lambda x, i: torch.nn.functional.embedding(i, x))
    x = torch.arange(16.0).reshape(4, 4)
    f(x, torch.tensor([[1, 2]]))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(IndexError):
        warnings.simplefilter("always")
        f(x, torch.tensor([[1, 4]]))
    assert not [w for w in caught if "bug in clika_runtime" in str(w.message)] and not f.eager_keys


def test_trap_warnings_made_errors_raise_as_themselves_and_change_nothing():
    """Under ``python -W error`` (pytest's ``filterwarnings = error``) a note said during a capture
    (forward hooks that keep what they see) raised from the middle of it: the library took it for
    its own failure, refused the key for good ("this is a bug in clika_runtime") and every later
    call ran eagerly. The note now raises from the call once the capture is done, as itself."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    kept = []
    model[0].register_forward_hook(lambda module, args, out: kept.append(out))
    f = cr.compile(model)
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="grad mode is on") as raised:
            f(x)  # a call that stays eager: said, raised as it is
        assert BUG not in str(raised.value)
        with torch.no_grad(), pytest.raises(UserWarning, match="forward hooks on '0'") as raised:
            f(x)
        assert BUG not in str(raised.value)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(f(x), model(x))
    assert f.eager_keys == {} and f.state is cr.CompiledFunction.State.Compiled
    assert sum(c.hits for c in f.captures) == 3
