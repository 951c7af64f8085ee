"""Calls from several threads at once: right results, no deadlock, no call waiting on another's
eager run, one capture per key, and sessions freed as soon as nothing uses them."""

from __future__ import annotations

import copy
import gc
import itertools
import queue
import random
import sys
import threading
import time
import types
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import current

import clika_runtime as cr
from clika_runtime.base.sharing import TARGETS

State = cr.CompiledFunction.State


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
    assert f.state is State.Compiled


def _all_at_once(threads: int, call) -> list:
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda _: call(), range(threads), timeout=120))


def test_calls_in_fallback_and_after_take_graph_run_concurrently():
    # Each call waits until four calls are inside the target at once: a lock around the eager
    # target would break the barrier (its timeout) instead of letting them meet.
    meet = threading.Barrier(4, timeout=30)
    gate = {"open": False}

    def branchy(x):  # a data-dependent branch: the capture fails, the function falls back
        if gate["open"]:
            meet.wait()
        return x + 1 if x.sum() > 0 else x - 1

    def doubled(x):
        if gate["open"]:
            meet.wait()
        return x * 2

    fallen, taken = cr.compile(branchy), cr.compile(doubled)
    with pytest.warns(UserWarning, match="capture failed"):
        fallen(torch.ones(2))
    taken(torch.ones(2))
    taken.take_graph()
    assert fallen.state is State.Fallback and taken.state is State.Fallback
    gate["open"] = True
    assert all(torch.equal(y, torch.full((2,), 2.0)) for y in _all_at_once(4, lambda: fallen(torch.ones(2))))
    assert all(torch.equal(y, torch.full((2,), 2.0)) for y in _all_at_once(4, lambda: taken(torch.ones(2))))


def test_a_capture_in_progress_blocks_neither_hits_on_other_keys_nor_a_second_miss_of_its_key():
    release = threading.Event()
    entered = threading.Event()
    eager_calls = []

    def target(x, mode):
        if mode == "slow" and not release.is_set() and not entered.is_set():  # the first (eager) call
            entered.set()
            assert release.wait(30), "the other calls did not return while this capture was in progress"
        eager_calls.append(mode)
        return x * 2 if mode == "slow" else x + 1

    f = cr.compile(target)
    x = torch.ones(2)
    f(x, "fast")  # key A captured
    with ThreadPoolExecutor(max_workers=2) as pool:
        slow = pool.submit(f, x, "slow")  # key B: its eager run waits inside the target
        assert entered.wait(30)
        torch.testing.assert_close(f(x, "fast"), x + 1)  # a hit on key A meanwhile
        release.set()
        torch.testing.assert_close(slow.result(timeout=60), x * 2)
    assert f.recapture_count == 1


def test_two_threads_missing_one_key_make_one_capture():
    meet = threading.Barrier(2, timeout=30)
    arrived = []

    def target(x):
        arrived.append(1)
        if len(arrived) <= 2:
            meet.wait()  # both eager calls are inside the target before either returns
        return x.sin()

    f = cr.compile(target)
    outs = _all_at_once(2, lambda: f(torch.ones(3)))
    for out in outs:
        torch.testing.assert_close(out, torch.ones(3).sin())
    assert f.state is State.Compiled and len(f.captures) == 1 and f.recapture_count == 0


def _session_ref(f) -> weakref.ref:
    return weakref.ref(current(f).parts.runner.session)


@pytest.mark.parametrize("drop", ["evict", "reset", "take_graph", "fallback"])
def test_a_dropped_capture_frees_its_session_without_the_garbage_collector(drop):
    cr.config.cache_size = 1
    f = cr.compile(lambda x, k: x + k, specialize=True)
    f(torch.ones(2), 1)
    ref = _session_ref(f)
    gc.disable()
    try:
        if drop == "evict":
            f(torch.ones(2), 2)  # the only slot goes to k=2
        elif drop == "reset":
            f.reset()
        elif drop == "take_graph":
            f.take_graph()
        else:
            cr.config.recapture_limit = 0
            with pytest.warns(UserWarning, match="re-capture limit"):
                f(torch.ones(2), 3)
        assert ref() is None, f"the session outlived the capture after {drop}"
    finally:
        gc.enable()


class _ReadersWriter:
    """Calls share the weights (readers); a weight update has them alone (the writer)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    def read(self, fn):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            return fn()
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def write(self, fn):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            fn()
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def _scale_weights(models, factor: float) -> None:
    with torch.no_grad():
        for m in models:
            m[0].weight.mul_(factor)


@pytest.mark.slow
def test_stress_hits_drifts_resets_takes_and_weight_updates_never_serve_a_wrong_answer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval()
    # The reference is a twin updated alike: torch.export swaps a module's parameters for fakes
    # while it traces, so nothing may call the compiled module directly during a capture.
    twin = copy.deepcopy(model)
    f = cr.compile(model)
    weights = _ReadersWriter()
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            op = rng.random()
            if op < 0.08:
                f.reset()
            elif op < 0.12:
                try:
                    f.take_graph()
                except cr.StateError:
                    pass
            elif op < 0.2:
                weights.write(lambda: _scale_weights((model, twin), 0.9))
            else:
                x = torch.randn(rng.choice([1, 2, 3, 5]), 4)

                def call():
                    with torch.no_grad():
                        got = f(x)
                        with TARGETS.shared():  # torch.export patches module calls process-wide while it traces
                            return got, twin(x)

                got, expected = weights.read(call)
                if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
                    errors.append((tuple(x.shape), (got - expected).abs().max().item()))

    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(worker, seed) for seed in range(8)]:
            future.result(timeout=600)
    assert not errors, errors


class _EncoderHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        self.head = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])

    def forward(self, x):
        return self.head(self.encoder(x))


def test_trap_module_calls_in_other_threads_during_a_capture_run_as_without_it():
    """While torch.export traces, torch.fx replaces ``nn.Module.__call__`` for the whole process:
    a module of the traced model called from another thread went through that trace's tracer,
    and both failed on its module stack (``generate`` in one thread calls its encoder while
    another thread's call captures the decoder: an AssertionError in each). Such a call now
    waits for the export and computes with the module's own weights; a module outside the
    traced model runs at once; the capture is made."""
    model = _EncoderHead().eval()
    elsewhere = torch.nn.Linear(4, 4).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = (model.encoder[0](x), elsewhere(x))
    unpatched = torch.nn.Module.__call__
    done, failures, traced_meanwhile = threading.Event(), [], [0]

    def call_modules() -> None:
        while not done.is_set():
            if torch.nn.Module.__call__ is unpatched:  # not tracing now: nothing to test
                time.sleep(0)
                continue
            try:
                with torch.no_grad():
                    torch.testing.assert_close((model.encoder[0](x), elsewhere(x)), expected)
                traced_meanwhile[0] += 1
            except Exception as error:  # collected, asserted below
                failures.append(error)
                return

    other = threading.Thread(target=call_modules)
    other.start()
    f = cr.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture would warn
        with torch.no_grad():
            torch.testing.assert_close(f(x), model(x))
    done.set()
    other.join()
    assert not failures, repr(failures[0])
    assert traced_meanwhile[0] > 0 and len(f.captures) == 1


# ---------------------------------------------------------------- other threads during a first call
# Each test below holds one thread at a set point of another's first call (an Event, not a sleep):
# the race the trial found by chance happens every run.


class _Paused(torch.nn.Module):
    """A linear layer whose eager (not traced) calls run ``pause()`` once computed: where another
    thread changes the model meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.pause = _no_pause

    def forward(self, x):
        y = self.fc(x)
        if not torch.compiler.is_exporting():
            self.pause()
        return y


def _no_pause() -> None:
    pass


class _Tempered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Paused()
        self.temperature = 1.0

    def forward(self, x):
        return self.body(x) / self.temperature


class _Cooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Paused()
        self.temperature = 1.0

    def forward(self, x):
        return self.body(x / self.temperature)


class _TrainDoubles(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Paused()

    def forward(self, x):
        return self.body(x) * (2.0 if self.training else 1.0)


def _meanwhile(model: torch.nn.Module, change) -> threading.Thread:
    """A thread that runs ``change()`` while the model's next eager call is paused in ``body``."""
    inside, changed = threading.Event(), threading.Event()

    def pause() -> None:
        model.body.pause = _no_pause  # once
        inside.set()
        assert changed.wait(30)

    def other() -> None:
        assert inside.wait(30)
        change()
        changed.set()

    model.body.pause = pause
    thread = threading.Thread(target=other)
    thread.start()
    return thread


def test_trap_an_attribute_another_thread_sets_during_the_first_call_stays_watched():
    """Another thread set ``model.temperature`` while the first call ran eagerly (a config
    endpoint of a server). The attribute moved during the call, so it was taken as written by
    the target itself and never watched: the next change (4.0) was served stale from the graph
    baked with 2.0. The target does not write it when traced again, so it is watched."""
    torch.manual_seed(0)
    model, x = _Tempered().eval(), torch.randn(2, 4)
    f = cr.compile(model)

    def change() -> None:
        model.temperature = 2.0

    thread = _meanwhile(model, change)
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))
    thread.join()
    model.temperature = 4.0
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(f(x), model(x))
    assert sum(c.hits for c in f.captures) == 1 and not f.fallback_reason


def test_trap_train_called_from_another_thread_during_the_first_eval_call_serves_no_training_graph():
    """Another thread called ``model.train()`` while the first (eval) call ran eagerly: the graph
    was traced in training mode and filed under the eval key, and later eval calls were served
    training-mode numbers (x2 here; dropout and batch statistics in a real model)."""
    torch.manual_seed(0)
    model, x = _TrainDoubles().eval(), torch.randn(2, 4)
    f = cr.compile(model)
    thread = _meanwhile(model, model.train)
    with torch.no_grad():
        f(x)
    thread.join()
    for mode in ("eval", "train", "eval", "train"):
        getattr(model, mode)()
        with torch.no_grad():
            torch.testing.assert_close(f(x), model(x), msg=mode)
    assert not f.fallback_reason


def _weights_bumped(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.body.fc.weight.add_(1.0)


def _cooled(model: torch.nn.Module) -> None:
    model.temperature = 2.0


@pytest.mark.parametrize("change", [_weights_bumped, _cooled], ids=["weights-in-place", "attribute-read-before"])
def test_trap_a_model_changed_by_another_thread_while_its_first_call_captures_is_captured_again(change):
    """Another thread changed what the call had already read (a training step's in-place update,
    an attribute) after the eager run used it and before the export read it. The graph then
    disagreed with the eager result, and that failed verification refused the key for good
    ("serves eagerly until reset()"). A failure while the model changed meanwhile refuses
    nothing: the next call captures again (and spends the re-capture budget, which a model
    changed on every call exhausts)."""
    torch.manual_seed(0)
    model, x = _Cooled().eval(), torch.randn(2, 4)
    f = cr.compile(model)
    thread = _meanwhile(model, lambda: change(model))
    with warnings.catch_warnings(record=True) as said, torch.no_grad():
        warnings.simplefilter("always")
        f(x)
        thread.join()
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert not [w for w in said if "eagerly" in str(w.message)], [str(w.message) for w in said]
    assert sum(c.hits for c in f.captures) >= 1 and not f.fallback_reason


class _StepsElsewhere(torch.nn.Module):
    """After each eager call, while ``stepping``, another thread writes its weights in place (a
    training step made every time a capture is made); ``traces`` counts its traced calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.stepping = True
        self.traces = itertools.count()  # not an int: the export puts a module's attributes back

    def forward(self, x):
        y = self.fc(x)
        if torch.compiler.is_exporting():
            next(self.traces)
        elif self.stepping:
            step = threading.Thread(target=_step, args=(self.fc.weight,))
            step.start()
            step.join()
        return y


def _step(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.add_(1.0)


def test_a_model_changed_while_every_capture_is_made_runs_eagerly_past_the_budget_until_it_holds_still():
    """Each capture's eager run and its export see different weights: none is made, and each
    spends the re-capture budget. Past it, calls run eagerly without exporting, saying why, until
    the weights hold still over two calls in a row; then the function captures and serves."""
    cr.config.recapture_limit = 2
    model, x = _StepsElsewhere().eval(), torch.randn(2, 4)
    f = cr.compile(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for call in range(6):
            if call == 3:
                traced = next(model.traces)
            with torch.no_grad():
                twin = copy.deepcopy(model)
                torch.testing.assert_close(f(x), twin(x))
        assert next(model.traces) == traced + 1 and not f.captures  # no export past the budget
        model.stepping = False
        with torch.no_grad():
            for _ in range(4):  # the last step, two calls with still weights, a capture, a hit
                torch.testing.assert_close(f(x), model(x))
    assert any("hold still" in str(w.message) for w in said), [str(w.message) for w in said]
    assert f.state is not State.Fallback and sum(c.hits for c in f.captures) >= 1


class _Signals(torch.nn.Module):
    """Two layers; a traced call sets ``tracing``, a call from ``waiter`` waits (up to 2 s) for
    it between its layers: a direct eager call in flight when an export begins."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.signals: dict = {}

    def forward(self, x):
        signals = self.signals
        if torch.compiler.is_exporting() and threading.get_ident() != signals.get("waiter"):
            signals["tracing"].set()
        h = self.first(x)
        if threading.get_ident() == signals.get("waiter"):
            signals["inside"].set()
            signals["tracing"].wait(2)
        return torch.nn.functional.linear(h, self.second.weight, self.second.bias)  # read mid-call


def test_trap_a_direct_call_in_flight_when_an_export_begins_finishes_with_real_weights():
    """A server's other endpoint called the model directly while ``f``'s first call exported it.
    torch.export swaps the model's parameters for fake tensors on the model itself: the direct
    call, already running, read them (a FakeTensor returned, or an AssertionError from fake
    mode). The export now waits for calls of its model running in other threads to end."""
    torch.manual_seed(0)
    model, x = _Signals().eval(), torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    model.signals.update(tracing=threading.Event(), inside=threading.Event())
    got: list = []

    def direct() -> None:
        model.signals["waiter"] = threading.get_ident()
        try:
            with torch.no_grad():
                got.append(model(x))
        except Exception as error:  # collected, asserted below
            got.append(error)

    other = threading.Thread(target=direct)
    other.start()
    assert model.signals["inside"].wait(30)
    f = cr.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(f(x), expected)
    other.join()
    assert type(got[0]) is torch.Tensor, repr(got[0])
    torch.testing.assert_close(got[0], expected)
    assert len(f.captures) == 1 and not f.fallback_reason


class _ReadDuringExport(torch.nn.Module):
    """Starts, once, while it is traced, a thread that reads its weights the ways a monitor, a
    checkpoint saver or an EMA update does; the thread is not waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
        self.read = queue.Queue()  # not a list: the export puts a module's lists back as they were

    def forward(self, x):
        if torch.compiler.is_exporting() and self.read.empty():
            self.read.put(threading.current_thread())
            threading.Thread(target=_read_weights, args=(self, self.read)).start()
        return self.norm(self.fc(x))


def _read_weights(model: torch.nn.Module, into: queue.Queue) -> None:
    try:
        with torch.no_grad():
            read = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()},
                    "parameters": [p.clone() for p in model.parameters()],
                    "attribute": model.fc.weight.norm()}
    except Exception as error:  # collected, asserted below
        read = {"raised": error}
    into.put(read)


def test_trap_weights_read_from_another_thread_during_an_export_are_the_real_ones():
    """torch.export swaps a model's parameters for fake tensors on the model itself: a monitor
    thread summing weight norms, a checkpoint saver's ``state_dict()`` or an EMA update got
    FakeTensors or an AssertionError from fake mode, and the capture failed with it. Reads of
    the traced model's weights from other threads now wait for the export to end."""
    torch.manual_seed(0)
    model, x = _ReadDuringExport().eval(), torch.randn(2, 4)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    f = cr.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))
    model.read.get(timeout=5)  # the tracing thread
    read = model.read.get(timeout=30)
    assert "raised" not in read, repr(read.get("raised"))
    assert all(type(v) is torch.Tensor for v in read["state_dict"].values()), read["state_dict"]
    torch.testing.assert_close(read["state_dict"], expected)
    torch.testing.assert_close(read["parameters"], list(expected.values()))
    torch.testing.assert_close(read["attribute"], expected["fc.weight"].norm())
    assert len(f.captures) == 1 and not f.fallback_reason


class _PooledEnsemble(torch.nn.Module):
    """A forward that runs its members on a thread pool (a parallel ensemble)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList([torch.nn.Linear(4, 3) for _ in range(3)])
        self.pool = pool

    def forward(self, x):
        return torch.stack(list(self.pool.map(lambda m: m(x), self.members))).mean(0)


def test_trap_a_forward_that_calls_its_modules_on_a_thread_pool_runs_eagerly_and_never_hangs():
    """The first compiled call of such a forward hung for ever: during the export, the pool's
    calls of the model's modules waited for the export, which waited for them. A trace follows
    one thread, so it cannot be captured: the export fails saying so and the calls run eagerly."""
    torch.manual_seed(0)
    pool = ThreadPoolExecutor(3)
    model, x = _PooledEnsemble(pool).eval(), torch.randn(2, 4)
    f = cr.compile(model)
    got: list = []

    def first_call() -> None:
        with warnings.catch_warnings(record=True) as said, torch.no_grad():
            warnings.simplefilter("always")
            got.append((f(x), f(x), [str(w.message) for w in said]))

    caller = threading.Thread(target=first_call, daemon=True)
    caller.start()
    caller.join(120)
    pool.shutdown(wait=not caller.is_alive())
    assert not caller.is_alive(), "the first compiled call hangs"
    first, second, said = got[0]
    with torch.no_grad(), ThreadPoolExecutor(3) as model.pool:
        torch.testing.assert_close((first, second), (model(x), model(x)))
    assert not f.captures and any("another thread" in s for s in said), said


def _prints_while_traced(x):
    """Another thread prints while this function is exported."""
    if torch.compiler.is_exporting():
        other = threading.Thread(target=print, args=("a line from another thread",))
        other.start()
        other.join()
    return x + 1


def test_trap_what_other_threads_print_during_an_export_is_printed(capfd):
    """The export's own chatter is kept off the console by swapping ``sys.stdout``, which is the
    whole process's: a server's request logs printed by other threads meanwhile were lost."""
    f = cr.compile(_prints_while_traced)
    f(torch.randn(2, 3))
    assert "a line from another thread" in capfd.readouterr().out
    assert len(f.captures) == 1


def test_prints_of_other_threads_during_an_export_without_a_console_write_nothing(monkeypatch):
    """With no ``sys.stdout`` (pythonw, a daemon), ``print`` writes nothing; it must not raise in
    another thread because an export is quieting the console."""
    raised: list = []
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    f = cr.compile(_prints_while_traced)
    f(torch.randn(2, 3))
    assert not raised and len(f.captures) == 1


class _CallsCompiled(torch.nn.Module):
    """A model whose forward, in a direct call from another thread, waits until an export holds
    the library's process-wide turn, then calls a compiled function (which waits for that turn)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        if threading.current_thread() is not threading.main_thread():
            deadline = time.monotonic() + 30
            while not TARGETS._exclusive and time.monotonic() < deadline:
                time.sleep(0.001)
            return self.inner(self.fc(x))
        return self.fc(x)


def test_an_export_does_not_wait_for_a_thread_inside_its_model_that_waits_for_the_export():
    """A thread inside a call of the traced model (``generate`` stepping a model whose forward is
    compiled) that waits for its turn behind the export uses nothing of the model meanwhile: the
    export does not wait for it to leave (it waited 10 s, the bound of that wait)."""
    torch.manual_seed(0)
    model, x = _CallsCompiled(cr.compile(torch.nn.Linear(4, 4).eval())).eval(), torch.randn(2, 4)
    got: list = []

    def direct() -> None:
        with torch.no_grad():
            got.append(model(x))

    other = threading.Thread(target=direct)
    other.start()
    f = cr.compile(model)
    started = time.monotonic()
    with torch.no_grad():
        torch.testing.assert_close(f(x), model.fc(x))
    took = time.monotonic() - started
    other.join(60)
    assert not other.is_alive() and len(got) == 1
    torch.testing.assert_close(got[0], model.inner(model.fc(x)))
    assert took < 8, f"the first call took {took:.1f} s"


class _SetDuringExport(torch.nn.Module):
    """While traced (once), another thread sets ``temperature`` on the model (which waits for the
    export to end) or ``config.scale`` on a plain object (which does not)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.temperature = 1.0
        self.config = types.SimpleNamespace(scale=1.0)
        self.what, self.started = what, queue.Queue()

    def forward(self, x):
        if torch.compiler.is_exporting() and self.started.empty():
            setter = threading.Thread(target=_set_later, args=(self, self.what))
            self.started.put(setter)
            setter.start()
            if self.what == "config.scale":
                setter.join()
        return self.fc(x) / self.temperature * self.config.scale


def _set_later(model: torch.nn.Module, what: str) -> None:
    if what == "temperature":
        model.temperature = 2.0
    else:
        model.config.scale = 5.0


@pytest.mark.parametrize("what", ["temperature", "config.scale"])
def test_trap_an_attribute_another_thread_sets_during_the_export_is_seen_by_the_next_call(what):
    """``temperature`` set on the model during the export waits for the export to end, and then
    landed before the capture's watch was made: the watch read 2.0, the graph had baked 1.0, and
    the graph served 0.63 off for good. ``config.scale`` on a plain object is set at once: the
    trace read 5.0, the eager run 1.0, and that failed verification refused the key for good."""
    torch.manual_seed(0)
    model, x = _SetDuringExport(what).eval(), torch.randn(2, 4)
    f = cr.compile(model)
    with warnings.catch_warnings(record=True) as said, torch.no_grad():
        warnings.simplefilter("always")
        f(x)
        model.started.get(timeout=5).join(30)
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert not [w for w in said if "eagerly" in str(w.message)], [str(w.message) for w in said]
    assert sum(c.hits for c in f.captures) >= 1


class _Locked(torch.nn.Module):
    """A forward under a lock that another endpoint also takes; traced, it waits until the other
    thread holds the lock (and uses the model under it) before it asks for the lock itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 4)
        self.lock = threading.Lock()
        self.tracing, self.locked = threading.Event(), threading.Event()

    def forward(self, x):
        if torch.compiler.is_exporting() and not self.tracing.is_set():
            self.tracing.set()
            self.locked.wait(30)
        with self.lock:
            return self.net(x)


def test_a_thread_that_holds_what_an_export_waits_for_gets_an_error_not_a_deadlock(monkeypatch):
    """Another endpoint took the model's lock and called a submodule while the export waited for
    that lock: the call waited for the export, the export for the lock, for ever. A use that has
    waited ``STUCK_AFTER`` seconds for an export that has not moved since raises, saying why."""
    from exporters import other_threads

    monkeypatch.setattr(other_threads, "STUCK_AFTER", 1.0, raising=False)
    torch.manual_seed(0)
    model, x = _Locked().eval(), torch.randn(2, 4)
    raised: list = []

    def endpoint() -> None:
        model.tracing.wait(60)
        with model.lock:
            model.locked.set()
            try:
                with torch.no_grad():
                    model.net(x)
            except Exception as error:  # collected, asserted below
                raised.append(error)

    other = threading.Thread(target=endpoint, daemon=True)
    other.start()
    f = cr.compile(model)

    def first_call() -> None:
        with torch.no_grad():
            f(x)

    first = threading.Thread(target=first_call, daemon=True)
    first.start()
    first.join(30)
    other.join(30)
    assert not first.is_alive() and not other.is_alive(), "deadlock"
    assert raised and "has not moved" in str(raised[0]), raised
    with torch.no_grad():
        torch.testing.assert_close(f(x), model.net(x))
