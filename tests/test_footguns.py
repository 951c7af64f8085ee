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

import dataclasses
import functools
import re
import warnings

import pytest
import torch
from torch import is_grad_enabled as _grad_on
from conftest import Counted, current

import clika_runtime as cr
from clika_runtime import CaptureError

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


class _GradBranches(torch.nn.Module):
    def forward(self, x):
        return _grad_branch(x)


def _grad_branch(x):
    return x * 2 if torch.is_grad_enabled() else x * 3


def _aliased_branch(x):
    return x * 2 if _grad_on() else x * 3


class _CallableBranch:
    def __call__(self, x):
        return x * 2 if torch.is_grad_enabled() else x * 3


def _closing_over_a_helper():
    helper = _grad_branch
    return lambda x: helper(x)


class _StaticAsks(torch.nn.Module):
    @staticmethod
    def adjust(x):
        return x * 2 if torch.is_grad_enabled() else x * 3

    def forward(self, x):
        return self.adjust(x)


class _HelperAsks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.helper = _CallableBranch()  # a plain object held as an attribute

    def forward(self, x):
        return self.helper(x)


class _HookAsks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_forward_hook(lambda module, args, out: out * 2 if torch.is_grad_enabled() else out * 3)

    def forward(self, x):
        return x


@pytest.mark.parametrize("target", [_GradBranches(), _grad_branch, _aliased_branch, _CallableBranch(),
                                    _closing_over_a_helper(), _StaticAsks(), _HelperAsks(), _HookAsks()],
                         ids=["module", "function", "aliased", "callable-object", "closure", "staticmethod",
                              "helper-object", "hook"])
def test_trap_code_reading_grad_mode_is_not_served_the_other_modes_graph(target):
    # Captured under no_grad, a call in grad mode (nothing requiring grad) was served the no_grad
    # branch (a trial: 0.88 off). Graphs are traced under no_grad: grad-mode calls run eagerly,
    # and the no_grad graph still serves afterwards.
    f = cr.compile(target)
    x = torch.ones(3)
    with torch.no_grad():
        f(x), f(x)
    with pytest.warns(UserWarning, match="asks whether grad mode is on"):
        torch.testing.assert_close(f(x), x * 2)
    with torch.inference_mode():
        torch.testing.assert_close(f(x), x * 3)
    assert f.recapture_count == 0 and f.state is State.Compiled and f.captures[0].hits == 2
    with torch.no_grad():
        assert f._lifecycle.table.fresh()  # the served call's check passes (a lost inline read: 160x slower)


class _AsksOutsideItsForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.is_inference = True  # an attribute called like the tensor method
        self.fc = torch.nn.Linear(3, 3).requires_grad_(False)

    def fit_step(self, x):  # a training method the forward never calls
        return self.fc(x) if torch.is_grad_enabled() else None

    def forward(self, x):
        return self.fc(x)


def test_code_that_asks_about_modes_outside_the_forward_is_served_in_every_mode():
    # The walk read every method and attribute name: a training step asking for grad mode, or an
    # attribute called is_inference, made grad-mode and inference-mode calls eager (an attack).
    model = _AsksOutsideItsForward()
    f = cr.compile(model)
    x = torch.ones(2, 3)
    with torch.no_grad():
        f(x), f(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(f(x), model(x))
        with torch.inference_mode():
            torch.testing.assert_close(f(x), model(x))
    assert f.captures[0].hits == 3


def _inference_branch(x):
    return x * 2 if torch.is_inference_mode_enabled() else x * 3


def test_trap_code_reading_inference_mode_is_not_served_the_no_grad_graph():
    # Captured under no_grad, a call under inference_mode was served the other branch (an attack).
    f = cr.compile(_inference_branch)
    x = torch.ones(3)
    with torch.no_grad():
        f(x), f(x)
    with torch.inference_mode(), pytest.warns(UserWarning, match="asks whether inference mode is on"):
        torch.testing.assert_close(f(x), x * 2)
    with torch.no_grad():
        torch.testing.assert_close(f(x), x * 3)
    assert f.recapture_count == 0 and f.captures[0].hits == 2


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
    # With no tolerance, onnxruntime's softmax (its own exp and sum order) disagrees with eager's.
    cr.config.tolerances["float32"] = (0.0, 0.0)
    target = Counted(lambda x: torch.softmax(x, -1))
    f = cr.compile(target)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="disagrees with eager: output 'output': values differ"):
        f(x)
    assert f.state is State.Fallback
    calls = target.calls
    assert torch.equal(f(x), torch.softmax(x, -1)) and target.calls == calls + 1  # eager, exactly


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


def test_a_graph_failing_on_inputs_its_guard_accepts_gives_eagers_error_and_serves_on():
    table = torch.nn.Embedding(10, 4).eval()
    f = cr.compile(table)
    with torch.no_grad():
        f(torch.tensor([1, 2]))
        with pytest.raises(IndexError):  # onnxruntime fails on the bad index; eager says why
            f(torch.tensor([1, 12]))
        torch.testing.assert_close(f(torch.tensor([3, 4])), table(torch.tensor([3, 4])))
    # The inputs were bad, not the graph (eager raised on them too): it serves on, re-exported never.
    assert f.recapture_reasons == [] and f.state is State.Compiled and f.captures[0].hits >= 1


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


def test_the_same_tensor_passed_twice_is_two_inputs_of_the_graph():
    """torch.export merges inputs that are one object: a warm-up ``f(dummy, dummy)`` or
    self-attention ``mha(h, h, h)`` made a graph that read one of them for both."""
    target = Counted(lambda x, y: x * 2 - y)
    f = cr.compile(target)
    dummy = torch.randn(4, 6)
    f(dummy, dummy)
    calls = target.calls
    x, y = torch.ones(4, 6), torch.zeros(4, 6)
    torch.testing.assert_close(f(x, y), x * 2 - y)
    assert target.calls == calls  # served by the graph
    assert len(f.take_graph().input_names) == 2


def test_self_attention_capture_serves_cross_attention_right():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    f = cr.compile(mha)
    h = torch.randn(2, 5, 8)
    with torch.no_grad():
        f(h, h, h, need_weights=False)
        q, kv = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        served = f(q, kv, kv, need_weights=False)[0]
        torch.testing.assert_close(served, mha(q, kv, kv, need_weights=False)[0], rtol=1e-4, atol=1e-5)
    assert f.state is State.Compiled and f.recapture_count == 0


def test_a_float_computed_from_a_size_keeps_its_fraction():
    target = Counted(lambda x: (x * 2, x.shape[0] / 2))
    f = cr.compile(target, dynamic=True)
    f(torch.ones(4, 2))
    calls = target.calls
    _, half = f(torch.ones(5, 2))
    assert target.calls == calls  # served by the graph
    assert half == 2.5 and type(half) is float


@pytest.mark.parametrize("target, make", [
    (lambda x: (x * 2, x.shape[0] / 3), lambda n: torch.ones(n)),
    (lambda x: (x * 2, x.sum().item()), lambda n: torch.arange(n, dtype=torch.float64) / 7 + 0.1),
    (lambda x: x * x[0].item(), lambda n: torch.arange(1, n + 1, dtype=torch.float64) / 3),
], ids=["size-divided", "item-of-float64", "item-of-float64-inside"])
def test_trap_a_python_float_keeps_a_doubles_precision(target, make):
    """Served calls returned ``x.shape[0] / 3`` and ``.item()`` of a float64 tensor rounded to
    float32 (2.3333332538604736 for 7 / 3): the graph rounded the double to declare the number
    float32, then widened it back for the float64 output."""
    counted = Counted(target)
    f = cr.compile(counted, dynamic=True)
    f(make(4))
    calls = counted.calls
    for n in (7, 10):
        got, want = f(make(n)), target(make(n))
        got, want = (got[1], want[1]) if isinstance(want, tuple) else (got, want)
        assert counted.calls == calls  # served by the graph
        if isinstance(want, float):
            assert got == want and type(got) is float
        else:
            torch.testing.assert_close(got, want, rtol=1e-15, atol=0)


def test_a_float_read_out_of_a_tensor_is_judged_by_the_float32_tolerance():
    # .item() of a sum: onnxruntime adds in another order, and an exact compare refused the graph.
    target = Counted(lambda x: (x * 2, x.sum().item()))
    f = cr.compile(target)
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    f(x)
    assert f.state is State.Compiled, f.fallback_reason
    calls = target.calls
    _, total = f(x)
    assert target.calls == calls and type(total) is float  # served by the graph
    assert total == pytest.approx(x.sum().item(), rel=1e-4)


@pytest.mark.parametrize("draw", [
    lambda logits: torch.multinomial(torch.softmax(logits, -1), 1),
    lambda logits: logits * (torch.rand(()) < 0.5),
], ids=["multinomial", "coin"])
def test_random_draws_are_not_captured(draw):
    """A draw can pass the one verification by luck (a peaked distribution): such a graph would
    then draw from onnxruntime's generator, deaf to torch.manual_seed."""
    f = cr.compile(draw)
    logits = torch.tensor([[0.0, 0.0, 50.0]])
    with pytest.warns(UserWarning, match="draws random numbers"):
        f(logits)
    assert f.state is State.Fallback
    torch.manual_seed(3)
    first = [f(torch.zeros(1, 3)) for _ in range(5)]
    torch.manual_seed(3)
    again = [f(torch.zeros(1, 3)) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # eager, seeded


@pytest.mark.parametrize("lookup", [
    lambda x, i: torch.nn.functional.embedding(i, x),
    lambda x, i: torch.gather(x, 1, i),
    lambda x, i: torch.index_select(x, 1, i.flatten()),
    lambda x, i: torch.nn.functional.cross_entropy(x[:2], i.flatten()),  # labels padded with -1
    lambda x, i: torch.nn.functional.nll_loss(x[:2].log_softmax(-1), i.flatten(), reduction="none"),
    lambda x, i: x.scatter(1, i, 7.0),
    lambda x, i: x.scatter_add(1, i, x[:1, :2]),
    lambda x, i: x.scatter_reduce(1, i, x[:1, :2], "amax"),
    lambda x, i: x.index_add(1, i.flatten(), x[:, :2]),
    lambda x, i: x.index_copy(1, i.flatten(), x[:, :2]),
], ids=["embedding", "gather", "index_select", "cross_entropy", "nll_loss", "scatter", "scatter_add",
        "scatter_reduce", "index_add", "index_copy"])
def test_a_negative_index_raises_as_eager_does(lookup):
    """ONNX's Gather counts a negative index from the end; torch raises (an id of -1 used as
    padding). The graph must not answer with the last row."""
    target = Counted(lookup)
    f = cr.compile(target)
    x, bad = torch.arange(16.0).reshape(4, 4), torch.tensor([[1, -1]])
    f(x, torch.tensor([[1, 2]]))
    with pytest.raises((IndexError, RuntimeError)) as eager:
        lookup(x, bad)
    with pytest.raises(type(eager.value), match=re.escape(str(eager.value))):
        f(x, bad)
    f(x, torch.tensor([[2, 1]]))  # re-captures after a graph failure (the guard could not tell)
    calls = target.calls
    torch.testing.assert_close(f(x, torch.tensor([[0, 3]])), lookup(x, torch.tensor([[0, 3]])))
    assert target.calls == calls  # served again


@pytest.mark.parametrize("target, good, bad", [
    (lambda s: s[s > 0.5].max(), torch.tensor([0.9, 0.2, 0.7]), torch.tensor([0.1, 0.2, 0.3])),
    (lambda s: s[s > 0.5].amin(), torch.tensor([0.9, 0.2, 0.7]), torch.tensor([0.1, 0.2, 0.3])),
    (lambda s: s[s > 0.5].max(0).values, torch.tensor([0.9, 0.2, 0.7]), torch.tensor([0.1, 0.2, 0.3])),
    (lambda x: x[x[:, 0] > 0.5].amax(0), torch.tensor([[0.9, 1.0], [0.1, 2.0]]), torch.tensor([[0.1, 1.0], [0.1, 2.0]])),
    (lambda labels: torch.nn.functional.one_hot(labels, 4), torch.tensor([0, 3, 1]), torch.tensor([0, 5, 1])),
    (lambda labels: torch.nn.functional.one_hot(labels, 4), torch.tensor([0, 3, 1]), torch.tensor([0, -1, 1])),
    (lambda r: torch.repeat_interleave(torch.tensor([1.0, 2.0]), r), torch.tensor([1, 2]), torch.tensor([-1, 2])),
    (lambda x: torch.bincount(x), torch.tensor([0, 1, 1]), torch.tensor([0, -1, 1])),
], ids=["max-of-none", "amin-of-none", "max-dim-of-none", "amax-dim-of-none", "one-hot-past-the-end",
        "one-hot-negative", "repeat-interleave-negative", "bincount-negative"])
def test_trap_values_eager_raises_on_raise_when_served(target, good, bad):
    """The max of a selection that came out empty was served as NaN, a label past ``one_hot``'s
    classes as a row of zeros, a negative count as a plausible tensor: eager raises on each."""
    counted = Counted(target)
    f = cr.compile(counted)
    f(good)
    torch.testing.assert_close(f(good.clone()), target(good))
    with pytest.raises((IndexError, RuntimeError)) as eager:
        target(bad)
    with pytest.raises(type(eager.value), match=re.escape(str(eager.value))):
        f(bad)
    calls = counted.calls
    torch.testing.assert_close(f(good.clone()), target(good))
    assert counted.calls == calls  # the graph serves on


@pytest.mark.parametrize("target", [lambda x: x.amax(0), lambda x: x.max(), lambda x: x.max(dim=1).values,
                                    lambda x: x.int().amin(0)], ids=["amax", "max", "max-dim", "int-amin"])
def test_a_max_of_booleans_over_a_dynamic_axis_serves_every_size(target):
    """The check that the reduced axes hold something multiplied a bool max by 1: onnxruntime
    refused the dynamic graph, and each size got a graph of its own (a regression a trial found)."""
    counted = Counted(target)
    f = cr.compile(counted)
    for n in (3, 5):
        f(torch.rand(n, n + 1) > 0.5)
    calls = counted.calls
    for n in (7, 9, 4):
        x = torch.rand(n, n + 1) > 0.5
        assert torch.equal(f(x), target(x))
    assert counted.calls == calls  # served at every size


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    logits: torch.Tensor | None = None


def _writes_the_batch(batch):
    batch["logits"] = batch["x"] * 2  # the "results into the batch" pattern
    return batch["logits"].sum(-1)


def _appends(xs):
    xs.append(xs[-1] * 2)
    return xs[0] + 1


def _sets_an_attribute(b):
    b.logits = b.x * 2
    return b.logits.softmax(-1)


def _pops(batch):
    return batch.pop("x") * 2


@pytest.mark.parametrize("target, make, seen", [
    (_writes_the_batch, lambda: {"x": torch.randn(3, 4)}, lambda a: sorted(a)),
    (_appends, lambda: [torch.randn(3)], len),
    (_sets_an_attribute, lambda: _Batch(torch.randn(3, 4)), lambda b: b.logits is not None),
    (_pops, lambda: {"x": torch.randn(3), "y": torch.randn(3)}, lambda a: sorted(a)),
], ids=["dict-key-added", "list-append", "dataclass-attribute", "dict-pop"])
def test_trap_a_target_that_writes_into_a_container_argument_is_not_served(target, make, seen):
    """Served calls dropped what the target wrote into the dict, list or dataclass it was given:
    the caller's batch lost its 'logits' from the second call on. Such a call is an input
    mutation, as an in-place write to a tensor is: it runs eagerly, the container written each call."""
    f = cr.compile(target)
    with torch.inference_mode():
        for _ in range(3):
            mine, theirs = make(), make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target(theirs)
                f(mine)
            assert seen(mine) == seen(theirs)
    assert "input mutation" in f.fallback_reason or any("input mutation" in why for why in f.eager_keys.values())
    assert "batch" in str(f.eager_keys) + str(f.fallback_reason) or target is not _writes_the_batch


def _features(features):
    """sentence-transformers' forward: adds its outputs to the dict it was given, returns it."""
    features["token_embeddings"] = features["input_ids"].float() * 2
    features["sentence_embedding"] = features["token_embeddings"].mean(1)
    return features


def test_trap_a_target_that_returns_the_dict_it_wrote_is_served_and_writes_it():
    """sentence-transformers' ``st.forward = cr.compile(st.forward)`` ran every call eagerly once
    writes into a container were refused (a regression a trial found): the dict it writes is
    the dict it returns, and a served call now writes the graph's values into it."""
    counted = Counted(_features)
    f = cr.compile(counted)
    with torch.inference_mode():
        f({"input_ids": torch.ones(2, 3, dtype=torch.long)})
        calls = counted.calls
        mine, theirs = {"input_ids": torch.arange(6).reshape(2, 3)}, {"input_ids": torch.arange(6).reshape(2, 3)}
        out = f(mine)
        _features(theirs)
    assert counted.calls == calls  # served
    assert out is mine and list(mine) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key])


@dataclasses.dataclass
class _Config:
    scale: float = 2.0

    @functools.cached_property
    def factor(self) -> float:
        return self.scale * 2


def _memo_read(x, cfg):
    if "_double" not in vars(cfg):
        cfg._double = cfg.factor * 2  # a private memo filled on first read
    return x * cfg._double


def _reinserted(batch):
    batch["x"] = batch.pop("x")  # the same entry, moved last: order is not a write
    return batch["x"] * 2


@pytest.mark.parametrize("target, make", [
    (_memo_read, lambda: (torch.randn(3), _Config())),
    (_reinserted, lambda: ({"x": torch.randn(3), "y": torch.randn(3)},)),
], ids=["memo-and-cached-property", "dict-entry-moved"])
def test_a_target_that_only_fills_memos_or_reorders_a_dict_is_served(target, make):
    """A cached_property or private memo filled on read, an entry popped and put back: no value
    a caller reads changed, yet the key served eagerly for good (a regression a trial found)."""
    counted = Counted(target)
    f = cr.compile(counted)
    with torch.inference_mode():
        f(*make())
        calls = counted.calls
        args = make()
        got = f(*args)
    assert counted.calls == calls  # served
    torch.testing.assert_close(got, target(*args))


def test_trap_a_write_deep_in_the_arguments_is_seen():
    """A write five levels down was dropped by served calls (the look stopped at four)."""
    def deep(tree):
        leaf = tree["a"]["b"]["c"]["d"]["e"]
        leaf["out"] = leaf["x"] * 2
        return leaf["x"] + 1

    f = cr.compile(deep)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            mine = {"a": {"b": {"c": {"d": {"e": {"x": torch.randn(3)}}}}}}
            f(mine)
            assert "out" in mine["a"]["b"]["c"]["d"]["e"]


def test_trap_a_model_output_the_target_writes_and_returns_is_left_whole():
    """A HuggingFace ModelOutput refuses ``update``: the write-back emptied the caller's object,
    then failed ("this is a bug in clika_runtime") on every call (a regression a trial found).
    Such a write is an input mutation: eager, the caller's object as eager leaves it."""
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class Feats(ModelOutput):
        x: torch.Tensor | None = None
        y: torch.Tensor | None = None

    def step(o):
        o["y"] = o.x * 2
        return o

    f = cr.compile(step)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(2, 4)
            mine = Feats(x=x)
            out = f(mine)
            assert out is mine and list(mine.keys()) == ["x", "y"] and torch.equal(mine.y, x * 2)
    assert not any("bug in clika_runtime" in str(w.message) for w in said)


def test_a_dict_the_target_writes_is_written_back_wherever_the_output_holds_it():
    """Returned inside a dataclass of a type never flattened before, twice, or holding a written
    dict of its own: each place holds the caller's object, as eager's does (a trial found the
    dataclass refused in a fresh process, one of two places a new dict, the inner dict refused)."""
    @dataclasses.dataclass
    class Out:
        batch: dict
        total: torch.Tensor

    def in_a_dataclass(b):
        b["y"] = b["x"] * 2
        return Out(b, b["y"].sum())

    def twice(b):
        b["y"] = b["x"] * 2
        return b, {"again": b}

    def nested(b):
        b["sub"]["w"] = b["x"] + 1
        return b

    cases = [(in_a_dataclass, lambda out, b: out.batch is b), (twice, lambda out, b: out[0] is b and out[1]["again"] is b),
             (nested, lambda out, b: out is b and out["sub"] is b["sub"] and "w" in b["sub"])]
    for target, holds in cases:
        counted = Counted(target)
        f = cr.compile(counted)
        with torch.inference_mode():
            f({"x": torch.randn(3), "sub": {}})
            calls = counted.calls
            mine, theirs = {"x": torch.randn(3), "sub": {}}, None
            theirs = {"x": mine["x"].clone(), "sub": {}}
            out = f(mine)
            target(theirs)
        assert counted.calls == calls, target.__name__  # served
        assert holds(out, mine), target.__name__
        torch.testing.assert_close(mine, theirs)


def test_a_written_back_dict_keeps_the_callers_own_tensors_where_the_target_left_them():
    """A served write-back refilled every entry with the graph's values: the caller's untouched
    ``input_ids`` came back as a copy (eager leaves the very tensor; a trial saw memory double)."""
    counted = Counted(_features)
    f = cr.compile(counted)
    with torch.inference_mode():
        f({"input_ids": torch.ones(2, 3, dtype=torch.long)})
        calls = counted.calls
        ids = torch.arange(6).reshape(2, 3)
        mine = {"input_ids": ids}
        f(mine)
    assert counted.calls == calls  # served
    assert mine["input_ids"] is ids and list(mine) == ["input_ids", "token_embeddings", "sentence_embedding"]


def test_a_written_back_dict_takes_what_the_target_moved_between_its_entries():
    def swap(batch):
        batch["x"], batch["y"] = batch["y"], batch["x"] * 2
        return batch

    counted = Counted(swap)
    f = cr.compile(counted)
    with torch.inference_mode():
        f({"x": torch.randn(3), "y": torch.randn(3)})
        calls = counted.calls
        x, y = torch.randn(3), torch.randn(3)
        mine = {"x": x, "y": y}
        f(mine)
    assert counted.calls == calls  # served
    torch.testing.assert_close(mine["x"], y)
    torch.testing.assert_close(mine["y"], x * 2)


def test_a_set_read_and_not_written_is_not_a_write():
    """A set's snapshot held fresh tuples, so an unchanged set always compared as written."""
    from clika_runtime.capture.containers import Held

    tags, seen = {"a", "b"}, {"x": {1, 2}}
    given = Held((tags, seen), {}, lambda i: f"args_{i}")
    assert given.written(torch.ones(1)) == []
    tags.add("c")
    assert given.written(torch.ones(1)) == ["args_0"]


def test_trap_a_lazy_module_compiled_before_its_first_call_is_served_after_it():
    # nn.LazyLinear's parameters are made by its first call: planning that call read them and was
    # reported as "a bug in clika_runtime", and the key ran eagerly for good (a trial).
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU()).eval()
    f = cr.compile(model)
    x = torch.randn(2, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert f.state is State.Compiled and f.captures[0].hits == 1


class _MadeConstants(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) + torch.tensor(0.1) * torch.ones(8)  # made in the default dtype


def test_trap_a_key_refused_under_another_default_dtype_captures_again_once_it_is_back():
    # Under set_default_dtype(torch.float64) the re-capture's graph failed to load; with float32
    # back, the state was the captured one again, but the key ran eagerly until reset() (a trial).
    model = _MadeConstants().eval()
    f = cr.compile(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        f(x), f(x)
        torch.set_default_dtype(torch.float64)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporter's graph fails to load, said as a refusal
                torch.testing.assert_close(f(x), model(x))
        finally:
            torch.set_default_dtype(torch.float32)
        f(x)
        torch.testing.assert_close(f(x), model(x))
    assert f.state is State.Compiled and f.captures[0].hits == 1


def test_a_reason_is_said_once_whatever_its_counts_say():
    # "re-capture limit (8) reached ... (spent by N model changed while capturing)": a thread changing
    # the weights beside calls moved N on every call, and the warning was said 80 times (a trial).
    f = cr.compile(lambda x: x + 1)
    with pytest.warns(UserWarning) as said:
        for spent in (8, 9, 10):
            f._lifecycle._say_once(f"re-capture limit (8) reached by weights that change between calls (spent by "
                                   f"{spent} model changed while capturing): calls run eagerly while they do")
        f._lifecycle._say_once("another reason")
    assert len(said) == 2, [str(w.message) for w in said]


def test_trap_a_resize_to_length_0_raises_as_eager_does():
    # A nearest resize by 1/3 at length 2 is 0 long: eager raises, the dynamic graph answered an
    # empty tensor (a trial).
    def shrink(x):
        return torch.nn.functional.interpolate(x, scale_factor=1 / 3, mode="nearest")

    counted = Counted(shrink)
    f = cr.compile(counted)
    with torch.no_grad():
        f(torch.randn(1, 2, 10)), f(torch.randn(1, 2, 12))
        with pytest.raises(RuntimeError, match="sizes should be greater than 0"):
            f(torch.randn(1, 2, 2))
        calls, x = counted.calls, torch.randn(1, 2, 9)
        torch.testing.assert_close(f(x), shrink(x))
    assert counted.calls == calls  # the graph serves on
