"""A capture that fails makes its own key serve eagerly: the other keys keep capturing and
serving (torch.compile falls back per frame). The budget and take_graph() still stop the whole
function."""

from __future__ import annotations

import pytest
import torch

import clika_runtime as cr
from conftest import Counted

State = cr.CompiledFunction.State


def _noisy(layer: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), layer, torch.nn.Linear(6, 2))


def test_a_training_mode_call_leaves_eval_calls_served():
    model = _noisy(torch.nn.Dropout(0.5))
    f = cr.compile(model)
    x = torch.randn(8, 6)
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"serves eagerly until reset\(\), for calls with the key \(input: "
                                             r"float32 on cpu, training\): capture failed: .*other keys still capture"):
            model.train()
            f(x)
        for _ in range(2):  # train -> eval -> train -> eval: eval calls are served, training calls eager
            model.eval()
            for _ in range(3):
                torch.testing.assert_close(f(x), model(x))
            model.train()
            f(x)
    assert f.state is State.Compiled and f.captures[0].hits == 5 and f.captures[0].key.endswith("eval")
    assert f.recapture_count == 0
    (words, why), = f.eager_keys.items()
    assert words.endswith("training") and why.startswith("capture failed")


def test_batch_norm_in_training_mode_leaves_eval_calls_served_on_its_new_statistics():
    model = _noisy(torch.nn.BatchNorm1d(6))
    f = cr.compile(model)
    x = torch.randn(8, 6)
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"for calls with the key \(input: float32 on cpu, training\)"):
            model.train()
            f(x)  # eager: updates the running statistics
        for _ in range(2):
            model.eval()
            for _ in range(3):
                torch.testing.assert_close(f(x), model(x))
            assert f.captures[0].hits == 2  # the eval graph of the statistics as they are now
            model.train()
            f(x)  # moves the statistics again: the next eval call captures them
    (reason,) = f.recapture_reasons  # the second eval phase: statistics the training call moved
    assert reason.startswith("weights changed: '1."), reason  # (num_batches_tracked: the kernel's own writes move no counter)
    assert f.state is State.Compiled and f.eager_keys and len(f.captures) == 1


def _scaled(x: torch.Tensor, in_place: bool) -> torch.Tensor:
    if in_place:
        x.mul_(2)
        return x
    return x * 2


def test_a_key_that_mutates_its_input_leaves_the_other_key_served():
    target = Counted(_scaled)
    f = cr.compile(target)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"in_place=True\): input mutation"):
        f(torch.ones(3), True)
    for _ in range(3):
        torch.testing.assert_close(f(torch.ones(3), False), torch.full((3,), 2.0))
        torch.testing.assert_close(f(torch.ones(3), True), torch.full((3,), 2.0))
    assert f.state is State.Compiled and f.captures[0].hits == 2
    assert target.calls == 1 + 2 + 3  # the refused key's calls (1 + 3), the other key's capture (eager + trace)


def test_nothing_captured_and_every_key_refused_reads_fallback_with_the_reason():
    f = cr.compile(lambda x, marks: x * len(marks))
    with torch.no_grad(), pytest.warns(UserWarning, match="unhashable type set"):
        f(torch.ones(2), {1, 2})  # a set cannot key a capture
    assert f.state is State.Fallback and "unhashable type set" in f.fallback_reason and not f.captures
    with torch.no_grad():
        f(torch.ones(2), (1, 2))
        f(torch.ones(2), (1, 2))
    assert f.state is State.Compiled and f.fallback_reason is None and f.captures[0].hits == 1


def test_reset_forgets_the_refused_keys():
    model = _noisy(torch.nn.Dropout(0.5)).train()
    f = cr.compile(model)
    with torch.no_grad(), pytest.warns(UserWarning):
        f(torch.randn(4, 6))
    assert f.eager_keys
    f.reset()
    assert f.eager_keys == {} and f.state is State.Pending


class _CastsToItsWeights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x.to(self.fc.weight.dtype))).float()


def test_trap_a_key_refused_for_its_weights_captures_again_once_they_are_converted_back():
    # m.double(): onnxruntime has no float64 Erf, so the key (a float32 input) was refused; after
    # m.float() it stayed eager for good, and f.state read Compiled with no capture and no reason.
    model = _CastsToItsWeights().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        f(x)
        model.double()
        with pytest.warns(UserWarning, match="Erf"):
            f(x)
        assert f.state is State.Fallback and "Erf" in f.fallback_reason and not f.captures
        # onnxruntime's words alone ("NOT_IMPLEMENTED: Could not find an implementation for Erf(13)")
        # left the fix to guess (a trial, with bfloat16): the reason names the kernel and the fix.
        assert "no Erf kernel for float64" in f.fallback_reason and "model.float()" in f.fallback_reason
        model.float()
        f(x)
        torch.testing.assert_close(f(x), model(x))
    assert f.state is State.Compiled and f.captures[0].hits == 1 and not f.eager_keys


class _MeanOverTime(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 0:  # a default row for an empty sequence, through an op whose graph is
            return torch.special.erfcx(self.fc.bias.expand(x.shape[0], 4) + 5.0)  # wrong (torchlib's: 0)
        return self.fc(x).mean(1)


def test_trap_a_size_whose_graph_fails_serves_eagerly_alone_and_says_so():
    # A length-0 graph disagrees with eager (its branch's erfcx): the warning said the whole key
    # served eagerly, and a later length 1 was never traced.
    model = _MeanOverTime().eval()
    f = cr.compile(model)
    with torch.no_grad():
        for length in (3, 5):
            f(torch.randn(2, length, 4))
        with pytest.warns(UserWarning, match=r"for calls with the key \(x: float32 on cpu, eval\) at "
                                             r"x_dim1=0: capture failed"):
            f(torch.randn(2, 0, 4))
        for length in (0, 1, 6, 1):
            x = torch.randn(2, length, 4)
            torch.testing.assert_close(f(x), model(x), equal_nan=True)
    assert list(f.eager_keys) == ["x: float32 on cpu, eval at x_dim1=0"]
    assert f.state is State.Compiled and len(f.captures) == 2  # the general graph, length 1's
