"""The capture lifecycle: first call, hits, re-captures, LRU, budget, reset, take_graph."""

from __future__ import annotations

import copy
import logging
import pickle
import weakref

import onnxruntime as ort
import pytest
import torch
from conftest import Counted, TinyNet

import clika_runtime as cr
from clika_runtime import StateError
from clika_runtime.base import memory

State = cr.CompiledFunction.State


def _mul_add(x, y):
    return x * y + 1


def test_first_call_is_eager_and_later_calls_never_reach_the_target():
    target = Counted(_mul_add)
    f = cr.compile(target)
    assert f.state is State.Pending
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out = f(x, y)
    assert f.state is State.Compiled
    calls_after_capture = target.calls
    torch.testing.assert_close(out, _mul_add(x, y))
    for _ in range(3):
        x2, y2 = torch.randn(4, 3), torch.randn(4, 3)
        torch.testing.assert_close(f(x2, y2), _mul_add(x2, y2))
    assert target.calls == calls_after_capture  # served by onnxruntime, not by Python
    assert f.recapture_count == 0


def test_positional_and_keyword_calls_share_one_capture():
    target = Counted(_mul_add)
    f = cr.compile(target)
    x, y = torch.randn(2), torch.randn(2)
    f(x, y)
    calls = target.calls
    torch.testing.assert_close(f(x, y=y), _mul_add(x, y))
    torch.testing.assert_close(f(x=x, y=y), _mul_add(x, y))
    assert target.calls == calls and f.recapture_count == 0


@pytest.fixture(scope="module")
def drifting():
    """One function through static capture, a drift on axis 1, then a drift on axis 0."""
    target = Counted(lambda x: (x * 2).sum(-1))
    f = cr.compile(target)
    history = []
    for shape in [(2, 5), (2, 5), (2, 9), (2, 13), (6, 13), (3, 4)]:
        x = torch.randn(shape)
        before = target.calls
        out = f(x)
        history.append((shape, target.calls - before, f.recapture_count, out, x))
    return f, history


def test_shape_drift_recaptures_then_serves_any_size_on_the_drifted_axes(drifting):
    f, history = drifting
    # shape, eager calls it cost (eager + export trace), recapture count after it
    eager = [calls > 0 for _, calls, _, _, _ in history]
    counts = [count for _, _, count, _, _ in history]
    assert eager == [True, False, True, False, True, False]
    assert counts == [0, 0, 1, 1, 2, 2]
    for _, _, _, out, x in history:
        torch.testing.assert_close(out, (x * 2).sum(-1))


def test_drift_reasons_name_input_axis_and_sizes(drifting):
    f, _ = drifting
    assert len(f.recapture_reasons) == f.recapture_count
    assert f.recapture_reasons == [
        "shape drift: input 'x' axis 1: 5 -> 9",
        "shape drift: input 'x' axis 0: 2 -> 6",
    ]


def test_reasons_are_logged(caplog):
    f = cr.compile(lambda x: x + 1)
    with caplog.at_level(logging.INFO, logger="clika_runtime"):
        f(torch.zeros(2))
        f(torch.zeros(3))
    assert any("shape drift: input 'x' axis 0: 2 -> 3" in r.getMessage() for r in caplog.records)


def test_a_superseded_capture_is_gone_when_its_memory_is_given_back(monkeypatch):
    # glibc keeps freed heap memory until asked: a trim that ran while the drift call still held
    # the superseded capture (BERT-base: its session, ~400 MiB) returned nothing of it.
    f = cr.compile(lambda x: x.relu() * 2)
    f(torch.randn(2, 3))
    (static,) = f._lifecycle.table.captures
    superseded = weakref.ref(static)
    del static
    trims: list[bool] = []
    monkeypatch.setattr(memory, "give_back", lambda: trims.append(superseded() is None))
    f(torch.randn(5, 3))  # drift: the dynamic capture supersedes the static one
    assert f.recapture_count == 1 and len(f.captures) == 1
    assert trims == [True]


def test_structure_and_static_value_changes_recapture_and_alternating_never_does():
    target = Counted(lambda x, mode: x + 1 if mode == "a" else x - 1)
    f = cr.compile(target)
    x = torch.randn(3)
    f(x, "a")
    f(x, "b")
    assert f.recapture_count == 1
    assert f.recapture_reasons == ["static value changed: 'mode' 'a' -> 'b'"]
    calls = target.calls
    for _ in range(3):
        torch.testing.assert_close(f(x, "a"), x + 1)
        torch.testing.assert_close(f(x, "b"), x - 1)
    assert target.calls == calls and f.recapture_count == 1


def test_dtype_rank_and_structure_changes_each_recapture():
    f = cr.compile(lambda x: x * 2)
    f(torch.ones(3))
    f(torch.ones(3, dtype=torch.float64))
    f(torch.ones(3, 1))
    assert f.recapture_count == 2
    assert "float32 rank 1" in f.recapture_reasons[0] and "float64 rank 1" in f.recapture_reasons[0]
    assert "rank 2" in f.recapture_reasons[1]
    g = cr.compile(lambda *xs: sum(xs))
    g(torch.ones(2))
    g(torch.ones(2), torch.ones(2))
    assert g.recapture_reasons[0].startswith("new structure:")


def test_lru_keeps_cache_size_captures():
    cr.config.cache_size = 2
    target = Counted(lambda x, k: x + k)
    f = cr.compile(target, specialize=True)
    x = torch.zeros(2)
    for k in (1, 2, 1, 2):
        f(x, k)
    assert f.recapture_count == 1
    f(x, 3)  # evicts k=1 (least recently used)
    calls = target.calls
    f(x, 2)
    assert target.calls == calls  # still cached
    torch.testing.assert_close(f(x, 1), x + 1)
    assert target.calls > calls and f.recapture_count == 3


def test_recapture_limit_falls_back_until_reset():
    cr.config.recapture_limit = 1
    f = cr.compile(lambda x, k: x + k, specialize=True)
    x = torch.zeros(2)
    f(x, 1)
    f(x, 2)
    assert f.state is State.Compiled and f.recapture_count == 1
    with pytest.warns(UserWarning, match="re-capture limit"):
        torch.testing.assert_close(f(x, 3), x + 3)
    assert f.state is State.Fallback and "re-capture limit (1) reached" in f.fallback_reason
    torch.testing.assert_close(f(x, 1), x + 1)  # eager from now on
    f.reset()
    assert f.state is State.Pending and f.recapture_count == 0 and f.recapture_reasons == []
    assert f.fallback_reason is None
    f(x, 5)
    assert f.state is State.Compiled


def test_take_graph_needs_compiled_and_names_the_state():
    f = cr.compile(lambda x: x + 1)
    with pytest.raises(StateError, match="State.Pending"):
        f.take_graph()


@pytest.fixture(scope="module")
def taken(tmp_path_factory):
    model = TinyNet().eval()
    target = Counted(model)
    f = cr.compile(target.fn)
    with torch.no_grad():
        f(torch.randn(2, 5, 8), torch.ones(2, 5))
        f(torch.randn(2, 7, 8), torch.ones(2, 7))  # axis 1 becomes dynamic
    graph = f.take_graph()
    path = graph.save(tmp_path_factory.mktemp("graph") / "tiny.onnx")
    return f, graph, path, model


def test_take_graph_hands_out_a_model_graph_and_serves_eagerly_after(taken):
    f, graph, _, model = taken
    assert f.state is State.Fallback
    assert graph.input_names == ["x", "mask"]
    assert graph.output_names == ["output"]
    assert graph.dynamic_axes == {"x": {1: "x_dim1"}, "mask": {1: "x_dim1"}, "output": {1: "x_dim1"}}
    assert graph.model_proto.graph.name == "TinyNet"
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(f(x, torch.ones(2, 3)), model(x, torch.ones(2, 3)))
    with pytest.raises(StateError, match="State.Fallback"):
        f.take_graph()


def test_saved_graph_runs_in_plain_onnxruntime_at_a_new_size(taken):
    _, _, path, model = taken
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x, mask = torch.randn(2, 11, 8), (torch.rand(2, 11) > 0.5).float()
    (out,) = session.run(None, {"x": x.numpy(), "mask": mask.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(x, mask), rtol=1e-4, atol=1e-5)


def test_target_exceptions_reach_the_caller_unchanged():
    def strict(x):
        if x.shape[0] != 3:
            raise ValueError("strict wants 3 rows")
        return x + 1

    f = cr.compile(strict)
    with pytest.raises(ValueError, match="strict wants 3 rows"):
        f(torch.zeros(2))
    assert f.state is State.Pending
    with pytest.raises(TypeError):
        f(torch.zeros(3), torch.zeros(3))
    f(torch.zeros(3))
    assert f.state is State.Compiled
    with pytest.raises(TypeError):
        f(torch.zeros(3), torch.zeros(3))  # wrong arity after capture: still the target's own error


def test_decorator_forms():
    @cr.compile
    def plain(x):
        return x + 1

    @cr.compile(place="cpu", graph_name="named")
    def configured(x):
        return x - 1

    torch.testing.assert_close(plain(torch.zeros(2)), torch.ones(2))
    torch.testing.assert_close(configured(torch.zeros(2)), -torch.ones(2))
    assert configured.take_graph().graph_name == "named"
    assert isinstance(plain, cr.CompiledFunction) and plain.__name__ == "plain"


def test_bound_method_target_names_inputs_after_its_parameters():
    model = TinyNet().eval()
    f = cr.compile(model.forward)
    with torch.no_grad():
        out = f(torch.randn(1, 2, 8), mask=torch.ones(1, 2))
    assert f.input_names == ["x", "mask"] and out.shape == (1, 2, 8)


def test_keyword_order_does_not_make_a_new_capture():
    target = Counted(lambda x, *, a, b: x + a - b)
    f = cr.compile(target)
    x, a, b = torch.ones(1), torch.full((1,), 2.0), torch.zeros(1)
    f(x, a=a, b=b)
    calls = target.calls
    torch.testing.assert_close(f(x, b=b, a=a), x + a - b)
    assert target.calls == calls and f.input_names == ["x", "a", "b"]


def test_a_function_without_inputs_and_one_without_tensor_outputs():
    constant = cr.compile(lambda: torch.arange(3.0))
    constant()
    torch.testing.assert_close(constant(), torch.arange(3.0))
    assert constant.state is State.Compiled
    nothing = cr.compile(lambda x: None)
    with pytest.warns(UserWarning, match="returns no tensor"):
        assert nothing(torch.ones(2)) is None
    assert nothing(torch.ones(2)) is None


def test_parameters_and_inputs_requiring_grad_are_served_under_no_grad():
    weight = torch.nn.Parameter(torch.ones(2))
    f = cr.compile(lambda x: x * 2)
    with torch.no_grad():
        f(weight)
        out = f(weight)
    torch.testing.assert_close(out, torch.full((2,), 2.0))
    assert not out.requires_grad and f.state is State.Compiled


def _forward_compiled():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    model.forward = cr.compile(model.forward, dynamic=True)
    return model


def test_a_model_with_a_compiled_forward_deep_copies_into_its_own_captures():
    # An EMA or teacher copy: copy.deepcopy raised "cannot pickle '_thread.RLock' object".
    model, x = _forward_compiled(), torch.randn(2, 4)
    model(x)
    twin = copy.deepcopy(model)
    assert twin.forward.__wrapped__.__self__ is twin and twin.forward.state is State.Pending
    with torch.no_grad():
        twin[0].weight.mul_(2)
        for size in (2, 2, 5):
            x = torch.randn(size, 4)
            torch.testing.assert_close(twin(x), twin[1](twin[0](x)))
            torch.testing.assert_close(model(x), model[1](model[0](x)))
    assert twin.forward.state is State.Compiled and model.forward.recapture_count == 0


def test_compiled_functions_pickle_as_their_target_and_options():
    model, x = _forward_compiled(), torch.randn(2, 4)
    model(x)
    again = pickle.loads(pickle.dumps(model))
    assert again.forward.state is State.Pending and again.forward.__wrapped__.__self__ is again
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
        assert again(torch.randn(3, 4)).shape == (3, 4)
    assert again.forward.recapture_count == 0  # dynamic=True came along
