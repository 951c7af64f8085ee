"""The re-capture budget counts waste, not work: drift, numbers that vary, captures dropped or
evicted before they served. New keys and weights that change after their graph served are
re-captures (``recapture_count``) that spend nothing; ``config.cache_size`` bounds the keys."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import Counted

import clika_runtime as cr

Fallback = cr.CompiledFunction.State.Fallback
State = cr.CompiledFunction.State


def _act(x: torch.Tensor, mode: str) -> torch.Tensor:
    return torch.relu(x) if mode == "relu" else torch.tanh(x) if mode == "tanh" else x * 2 if mode == "double" else -x


def test_string_keys_within_the_cache_never_spend_the_budget():
    cr.config.recapture_limit = 2
    target = Counted(_act)
    f = cr.compile(target)
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(3):
            for mode in ("relu", "tanh", "double", "negate"):
                for _ in range(3):
                    torch.testing.assert_close(f(x, mode), _act(x, mode))
    assert f.state is not Fallback and f.recapture_count == 3 and len(f.captures) == 4
    assert target.calls == 4 * 2  # each key: its eager call and its trace, once


def test_reloaded_weights_after_serving_never_spend_the_budget():
    cr.config.recapture_limit = 2
    model = torch.nn.Linear(4, 4).eval()
    f = cr.compile(lambda x, mode: _act(model(x), mode))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for reload in range(5):
            model.load_state_dict({k: v + 0.1 for k, v in model.state_dict().items()})
            for mode in ("relu", "tanh") * 5:
                torch.testing.assert_close(f(x, mode), _act(model(x), mode))
    assert f.state is not Fallback and f.recapture_count >= 5


def test_a_float_that_varies_on_every_call_spends_it_and_the_message_says_so():
    cr.config.recapture_limit = 2
    f = cr.compile(lambda x, scale: x * scale)
    x = torch.randn(3)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"re-capture limit \(2\) reached; last: static value "
                                                           r"changed.*\(torch\.tensor\(value\)\); spent by 2 static value changed"):
        for i in range(5):
            torch.testing.assert_close(f(x, 1.0 + i / 10), x * (1.0 + i / 10))
    assert f.state is Fallback


def test_weights_that_change_before_their_graph_serves_spend_it_then_wait_for_still_weights():
    """Past the budget, weights that change between calls (a training loop) run the calls eagerly
    without capturing, not for good: once the weights hold still over two calls in a row, a capture."""
    cr.config.recapture_limit = 2
    model = torch.nn.Linear(4, 4).eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"reached by weights that change between calls \(spent by "
                                                           r"2 weights changed before its graph served a call\)"):
        for _ in range(5):
            model.weight.add_(0.01)  # an update on every call: no graph would ever serve
            torch.testing.assert_close(f(x), model(x))
    # No graph serves while the weights keep changing: Pending, the next still call captures (it
    # read Compiled with no capture held: found by a trial).
    assert not f.captures and f.state is cr.CompiledFunction.State.Pending and "Pending, 0 capture(s)" in repr(f)
    with pytest.raises(cr.StateError, match="needs State.Compiled, but the function is in State.Pending: call it once"):
        f.take_graph()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert sum(c.hits for c in f.captures) == 1  # the second call in a row with still weights captured


def test_more_keys_in_rotation_than_the_cache_holds_says_to_raise_cache_size():
    cr.config.recapture_limit, cr.config.cache_size = 2, 2
    f = cr.compile(_act)
    x = torch.randn(3)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"spent by 2 a key evicted before it served a call \(more "
                                                           r"keys in use than cache_size=2; raise cr\.config\.cache_size\)"):
        for _ in range(3):
            for mode in ("relu", "tanh", "double"):
                torch.testing.assert_close(f(x, mode), _act(x, mode))
    assert f.state is Fallback


def test_drift_still_spends_it():
    """Past the budget, a size no graph of its key was traced for runs eagerly; the key's graph
    keeps serving the sizes it was traced for (torch.compile's behaviour past its cache limit)."""
    cr.config.recapture_limit = 1
    target = Counted(lambda x: x.sum(0) if x.shape[0] > 3 else x.sum(1))
    f = cr.compile(target)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"re-capture limit \(1\) reached: calls at sizes no graph "
                                                           r"of their key was traced for run eagerly.*spent by 1 shape drift"):
        for n in (2, 3, 5):  # 2 -> 3: drift makes axis 0 dynamic; 5: the other side of the branch
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x), x.sum(0) if n > 3 else x.sum(1))
    assert f.state is State.Compiled and f.recapture_count == 1
    calls = target.calls
    with torch.no_grad():
        torch.testing.assert_close(f(torch.ones(3, 4)), torch.ones(3, 4).sum(1))  # served by its graph
        torch.testing.assert_close(f(torch.ones(6, 4)), torch.ones(6, 4).sum(0))  # eager
    assert target.calls == calls + 1


def test_a_budget_spent_by_changing_weights_waits_for_still_weights_whatever_the_last_reason():
    """Checkpoints reloaded while requests of several batch sizes arrived: changing weights spent
    the budget, and a shape drift took its last unit, so the function fell back for good and
    stayed eager once the reloads stopped. A budget spent mostly by weights that changed between
    calls waits for still weights, whatever spends the last unit."""
    cr.config.recapture_limit = 2
    model = torch.nn.Linear(4, 4).eval()
    f = cr.compile(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model.weight.add_(0.01)  # an update on every call: each graph dropped before it serves
            x = torch.randn(2, 4)
            torch.testing.assert_close(f(x), model(x))
        for batch in (2, 5, 5, 5, 5):
            x = torch.randn(batch, 4)
            torch.testing.assert_close(f(x), model(x))
    assert f.state is not Fallback, f.fallback_reason
    assert sum(c.hits for c in f.captures) >= 1


def test_trap_keys_first_called_at_batch_1_never_spend_the_budget():
    """A key first called at batch 1 is traced there (torch.export specialises size 1); its next
    batch re-captured it dynamic and spent the budget as drift: a server whose new keys often
    start with a single request fell back for good (a trial: eight string modes)."""
    cr.config.recapture_limit = 2
    model = torch.nn.Linear(4, 4).eval()
    target = Counted(lambda x, mode: model(x) * len(mode))
    f = cr.compile(target)
    with torch.no_grad():
        for k in range(4):
            mode = "m" * (k + 1)
            for batch in (1, 4, 6, 2, 7):
                x = torch.randn(batch, 4)
                torch.testing.assert_close(f(x, mode), model(x) * len(mode))
        assert f.state is not Fallback, f.fallback_reason
        calls = target.calls
        f(torch.randn(5, 4), "m")
    assert target.calls == calls  # served
