"""Calls that differentiate: a training loop through a compiled model runs eagerly (backward()
works as without clika_runtime); inference under no_grad / inference_mode is served."""

from __future__ import annotations

import warnings

import pytest
import torch

import clika_runtime as cr


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))


def _batches(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(4, 6) for _ in range(n)]


def test_micro_batches_accumulate_gradients_as_eager():
    model, twin = _model(), _model()
    f = cr.compile(model)
    with pytest.warns(UserWarning, match=r"grad mode is on and the weights require grad \('0\.weight', .*torch\.inference_mode\(\)"):
        for x in _batches(4):  # no opt.step(): the weights stay, the gradients add up
            f(x).sum().backward()
            twin(x).sum().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)
    assert f.recapture_count == 0 and f.state is not cr.CompiledFunction.State.Fallback


def test_a_training_loop_with_steps_neither_recaptures_nor_falls_back():
    model = _model()
    f = cr.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in _batches(12):
            opt.zero_grad()
            f(x).pow(2).mean().backward()
            opt.step()
    assert f.recapture_count == 0 and f.state is cr.CompiledFunction.State.Pending and not f.captures
    with torch.inference_mode():  # evaluation after training: served
        x = torch.randn(3, 6)
        f(x)
        y = f(x)
        torch.testing.assert_close(y, model(x))
    assert f.state is cr.CompiledFunction.State.Compiled and f.captures[0].hits == 1


def test_a_served_function_runs_eagerly_once_grad_mode_comes_back():
    model = _model()
    f = cr.compile(model)
    x = torch.randn(3, 6)
    with torch.no_grad():
        f(x)
        f(x)
    hits = f.captures[0].hits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(x)
    assert out.requires_grad and f.captures[0].hits == hits  # eager, differentiable
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_frozen_weights_are_served_in_grad_mode_until_they_are_unfrozen():
    model = _model().requires_grad_(False)
    f = cr.compile(model)
    x = torch.randn(3, 6)
    f(x)
    f(x)
    assert f.captures[0].hits == 1
    model[2].weight.requires_grad_(True)  # fine-tune the head: the next call must be differentiable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(x)
    assert out.requires_grad
    out.sum().backward()
    assert model[2].weight.grad is not None


_SCALE = torch.nn.Parameter(torch.randn(4))


class _Holder:
    """A plain object (not a module) whose method reads a trainable tensor of its own."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.w


def _scaled(h: torch.Tensor) -> torch.Tensor:
    return h * _SCALE


@pytest.mark.parametrize("case", ["a global Parameter", "a plain object's Parameter"])
def test_trainable_tensors_outside_modules_keep_their_gradient_after_serving(case):
    holder = _Holder()
    fn, leaf = (_scaled, _SCALE) if case == "a global Parameter" else (holder.forward, holder.w)
    f = cr.compile(fn)
    h = torch.randn(2, 4)
    with torch.no_grad():
        f(h)
        f(h)
    assert f.captures[0].hits == 1
    leaf.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(h)  # grad mode on: the trainable tensor needs its gradient
    out.sum().backward()
    torch.testing.assert_close(leaf.grad, h.sum(0))


@pytest.mark.parametrize("form", ["module", "function"])
def test_trap_one_evaluation_call_an_epoch_leaves_the_function_served_once_training_ends(form):
    """A loop that evaluates one batch an epoch through ``f``: each capture's weights changed
    before it served a call, which spends the re-capture budget; once spent, the function fell
    back for good and stayed eager after training ended. While the weights keep changing between
    calls it now waits, eagerly, and captures once they hold still over two calls in a row; a
    function calling the model (a metric closing over it) fell back for good until this stop."""
    cr.config.recapture_limit = 2
    model = _model()
    f = cr.compile(model if form == "module" else lambda x: model(x))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train, held_out = _batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            model.train()
            model(train).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            with torch.no_grad():
                torch.testing.assert_close(f(held_out), model(held_out))
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(f(held_out), model(held_out))
    assert f.state is not cr.CompiledFunction.State.Fallback, f.fallback_reason
    assert sum(c.hits for c in f.captures) >= 1


def test_trap_a_function_calling_a_model_captures_again_once_the_model_is_back_in_eval():
    """A function closing over a model (a sentence embedding: the model, then a normalisation),
    called once while the model was in training mode: the capture failed on dropout, its key was
    refused until ``reset()``, and every call stayed eager after ``model.eval()`` (a new-user
    trial, int8 and fp32 alike). A module target keys its training flag; a function's key
    cannot, so a refusal made while a model it calls was training is tried again once that
    model's training flags change."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4)).eval()
    f = cr.compile(lambda x: torch.nn.functional.normalize(model(x), dim=-1))
    x = torch.randn(4, 16)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f(x)
        f(x)
        for _ in range(3):  # epochs
            model.train()
            f(x)  # dropout: no graph for this call
            model.eval()
            for _ in range(3):
                torch.testing.assert_close(f(x), torch.nn.functional.normalize(model(x), dim=-1))
    assert f.state is cr.CompiledFunction.State.Compiled and f.captures[-1].hits >= 1, f.fallback_reason
    refusals = [str(w.message) for w in said if "draws random numbers" in str(w.message)]
    assert len(refusals) == 1, refusals  # said once, not each epoch


@pytest.mark.parametrize("refused_in", ["train mode (dropout)", "eval mode (a value read back)"])
def test_trap_a_refused_function_is_not_exported_again_at_every_train_eval_switch(monkeypatch, refused_in):
    """The retry above, attacked: a model switched between train and eval on every call had its
    function exported again on every call, 120 exports in 60 calls where the refusal had nothing
    to do with the mode. A refusal made in eval mode ignores the flags, and the retries are
    bounded by the re-capture limit."""
    import numpy as np

    exports, export = [0], torch.export.export

    def counted(*args, **kwargs):
        exports[0] += 1
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    cr.config.recapture_limit = 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5) if "dropout" in refused_in
                                else torch.nn.BatchNorm1d(4))

    def fn(x):
        y = model(x)
        if "read back" in refused_in:
            return y + torch.from_numpy(np.asarray(y.detach().numpy().sum(), dtype=np.float32))  # not exportable
        return y

    f = cr.compile(fn)
    x = torch.randn(2, 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.train("dropout" in refused_in)
        f(x)  # refused
        for i in range(30):
            model.train(i % 2 == 1)
            f(x)
    assert exports[0] <= 8, exports[0]


def _write_in_another_process(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.weight.add_(1.0)


@pytest.mark.parametrize("shared", ["before-compile", "after-capture"])
def test_trap_weights_in_shared_memory_are_not_served_past_another_processs_writes(shared):
    """Hogwild training (``model.share_memory()``, a worker process stepping it) moves no version
    counter here: the evaluation through ``f`` kept serving the graph made before (a trial: 1.31
    off). Shared weights run eagerly, said once."""
    import torch.multiprocessing as mp

    model = torch.nn.Linear(8, 4)
    if shared == "before-compile":
        model.share_memory()
    f = cr.compile(model)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f(x), f(x)
        if shared == "after-capture":
            model.share_memory()
        worker = mp.get_context("fork").Process(target=_write_in_another_process, args=(model,))
        worker.start()
        worker.join(timeout=60)
        assert worker.exitcode == 0
        torch.testing.assert_close(f(x), model(x))
    assert any("in shared memory" in str(w.message) for w in said), [str(w.message) for w in said]
