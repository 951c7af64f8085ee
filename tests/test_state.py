"""Nothing stale, Python side: a module's attributes, its submodules and hooks, a config's flags,
a function's closure and globals are what the graph baked; when one changes, the next call
re-captures (and says which), and when none does, no call pays for a capture."""

from __future__ import annotations

import copy
import functools
import pickle
import types

import pytest
import torch
from conftest import Counted

import clika_runtime as cr
from clika_runtime.state.compare import kept
from clika_runtime.state.snapshot import Snapshot


class Knobs(torch.nn.Module):
    """A forward that reads plain attributes, a dict of flags, a config object and a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU()
        self.temperature = 1.0
        self.flags = {"negate": False}
        self.config = types.SimpleNamespace(scale=1.0, inner=types.SimpleNamespace(shift=0.0))
        self._calls = 0  # private bookkeeping: not watched, never a re-capture

    def forward(self, x):
        self._calls += 1
        y = self.act(self.fc(x)) / self.temperature * self.config.scale + self.config.inner.shift
        return -y if self.flags["negate"] else y


class Doubles(torch.nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


class WithChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Doubles()

    def forward(self, x):
        return self.child(x) + 1


def _captured(model: torch.nn.Module, calls: int = 2) -> tuple[torch.nn.Module, cr.CompiledFunction, torch.Tensor]:
    """``model`` (seeded, in eval mode) compiled and called ``calls`` times (a capture, then served)."""
    torch.manual_seed(0)
    model = model.eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(calls):
            f(x)
    return model, f, x


def _knobs() -> tuple[Knobs, cr.CompiledFunction, torch.Tensor]:
    return _captured(Knobs())


def _set_config_flag(m: Knobs) -> None:
    m.config.scale = 3.0


def _set_nested_config(m: Knobs) -> None:
    m.config.inner.shift = 5.0


def _swap_submodule(m: Knobs) -> None:
    m.act = torch.nn.Tanh()


@pytest.mark.parametrize(
    "change, changed",
    [
        (lambda m: setattr(m, "temperature", 2.0), "'temperature'"),
        (lambda m: m.flags.update(negate=True), "'flags'"),
        (_set_config_flag, "'config.scale'"),
        (_set_nested_config, "'config.inner.shift'"),
        (_swap_submodule, "submodules of the module"),
    ],
    ids=["attribute", "dict-in-place", "config", "nested-config", "parameterless-submodule"],
)
def test_trap_changed_python_state_is_not_served_stale(change, changed):
    model, f, x = _knobs()
    change(model)
    with torch.no_grad():
        served, eager = f(x), model(x)
        torch.testing.assert_close(served, eager)
        assert f.recapture_count == 1 and changed in f.recapture_reasons[0]
        torch.testing.assert_close(f(x), eager)  # the new capture serves
    assert f.recapture_count == 1


def test_trap_forward_hooks_added_and_removed_are_followed():
    model, f, x = _knobs()
    with torch.no_grad():
        handle = model.fc.register_forward_hook(lambda module, args, out: out * 10)
        torch.testing.assert_close(f(x), model(x))
        assert "forward hooks of 'fc'" in f.recapture_reasons[-1]
        handle.remove()
        torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 2


def test_trap_global_forward_hooks_are_followed():
    model, f, x = _knobs()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out + 1 if isinstance(out, torch.Tensor) else out)
    try:
        with torch.no_grad():
            torch.testing.assert_close(f(x), model(x))
    finally:
        handle.remove()
    assert f.recapture_count == 1 and "torch's" in f.recapture_reasons[0]


def test_private_bookkeeping_and_whole_model_mode_switches_do_not_recapture():
    model, f, x = _knobs()
    model.train()
    model.eval()  # the key holds the root's mode: back where it was
    model._calls = 100
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 0


def test_trap_one_submodule_switched_to_training_alone_is_a_change():
    model = WithChild().eval()
    f = cr.compile(model)
    x = torch.ones(3)
    with torch.no_grad():
        f(x)
        model.child.train()  # the root still says eval: the key alone cannot see it
        torch.testing.assert_close(f(x), model(x))
    assert "'child.training'" in f.recapture_reasons[0]


SCALE = 2.0


def test_trap_function_globals_and_closures_are_followed():
    global SCALE
    settings = {"shift": 1.0}
    target = Counted(lambda x: x * SCALE + settings["shift"])
    f = cr.compile(target)
    x = torch.ones(3)
    f(x)
    f(x)
    settings["shift"] = 5.0
    torch.testing.assert_close(f(x), x * 2 + 5)
    assert "closed-over 'settings'" in f.recapture_reasons[-1]
    SCALE = 3.0
    try:
        torch.testing.assert_close(f(x), x * 3 + 5)
        assert "global 'SCALE'" in f.recapture_reasons[-1]
    finally:
        SCALE = 2.0
    f(x)  # SCALE back to 2.0: re-captured once more, then served
    calls = target.calls
    torch.testing.assert_close(f(x), x * 2 + 5)
    assert target.calls == calls


def test_trap_bound_method_object_state_is_followed():
    class Scaler:
        def __init__(self) -> None:
            self.factor = 2.0

        def apply(self, x):
            return x * self.factor

    scaler = Scaler()
    f = cr.compile(scaler.apply)
    x = torch.ones(3)
    f(x)
    scaler.factor = 4.0
    torch.testing.assert_close(f(x), x * 4)
    assert "factor" in f.recapture_reasons[0]


def _targets() -> list:
    weight = torch.nn.Parameter(torch.ones(3))
    table = {"a": 1.0}
    model = Knobs()
    return [
        (lambda x: x * weight, None),  # one closed-over cell
        (lambda x: x * weight * table["a"], None),  # two cells
        (lambda x: x * SCALE, None),  # a global
        (model, model),
        (model.forward, model),
    ]


@pytest.mark.parametrize("index", range(5), ids=["one-cell", "two-cells", "global", "module", "method"])
def test_a_snapshot_taken_now_is_fresh_and_names_no_change(index):
    fn, owner = _targets()[index]
    snapshot = Snapshot.of(fn, owner)
    assert snapshot.parts and snapshot.fresh() and snapshot.changed() == []


def test_a_hot_loop_over_unchanged_state_never_recaptures():
    model, f, x = _knobs()
    calls = model._calls
    with torch.no_grad():
        for _ in range(20):
            f(x)
    assert f.recapture_count == 0 and model._calls == calls
    table = f._lifecycle.table  # the hot path's check and the snapshot's own agree (hooks made by the trace)
    with torch.no_grad():  # (in grad mode the hot path's check sends calls eager: the weights require grad)
        assert table.fresh() and table.snapshot.fresh() and table.snapshot.changed() == []


def test_trap_hf_config_flag_set_after_capture_is_followed():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64)).eval()
    f = cr.compile(model)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        f(ids, attention_mask=torch.ones_like(ids))
        model.config.output_hidden_states = True  # what a user does to read the layers' states
        served = f(ids, attention_mask=torch.ones_like(ids))
        eager = model(ids, attention_mask=torch.ones_like(ids))
    assert served.hidden_states is not None and len(served.hidden_states) == len(eager.hidden_states) == 3
    for got, expected in zip(served.hidden_states, eager.hidden_states):
        torch.testing.assert_close(got, expected)
    assert f.recapture_reasons == ["state changed: 'config.output_hidden_states'"]


def test_trap_calls_under_autocast_run_eagerly():
    model, f, x = _knobs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        served, eager = f(x), model(x)
    assert served.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(served, eager)
    fresh = cr.compile(Knobs().eval())  # a first call under autocast captures nothing
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert fresh(x).dtype == torch.bfloat16
    assert fresh.state is cr.CompiledFunction.State.Pending
    with torch.no_grad():
        assert f(x).dtype == torch.float32 and f.recapture_count == 0  # outside it: served as before


def test_trap_default_dtype_set_after_capture_is_followed():
    target = Counted(lambda x: x / 2)  # integer division's result takes the default dtype
    f = cr.compile(target)
    x = torch.arange(3)
    assert f(x).dtype == torch.float32
    torch.set_default_dtype(torch.float64)
    try:
        out = f(x)
        assert out.dtype == torch.float64 and "default dtype" in f.recapture_reasons[0]
    finally:
        torch.set_default_dtype(torch.float32)


class Remembers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(2))

    def forward(self, x):
        self.last.copy_(x)  # served calls could not do this
        return x * 2


def test_trap_a_forward_that_writes_its_buffers_is_not_captured():
    model = Remembers().eval()
    f = cr.compile(model)
    with pytest.warns(UserWarning, match=r"writes buffer\(s\) \['last'\]"):
        f(torch.full((2,), 1.0))
    for value in (2.0, 3.0):
        torch.testing.assert_close(f(torch.full((2,), value)), torch.full((2,), 2 * value))
        torch.testing.assert_close(model.last, torch.full((2,), value))  # eager ran: the write happened
    assert f.state is cr.CompiledFunction.State.Fallback and "return the new value" in f.fallback_reason


def test_trap_training_mode_batch_norm_is_not_served_without_its_statistics():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))  # training mode, as built
    f = cr.compile(model)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="running_mean"):
            f(torch.randn(4, 3))
        before = model[1].running_mean.clone()
        f(torch.randn(4, 3))
    assert not torch.equal(model[1].running_mean, before)  # eager updated the statistics
    assert ".eval()" in f.fallback_reason


class Notes(torch.nn.Module):
    """Writes a public attribute on every call (a debugging habit), never reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.last_batch = None

    def forward(self, x):
        self.last_batch = x.shape[0]
        return self.fc(x)


def test_trap_state_the_target_writes_itself_is_not_a_change_of_state():
    model = Notes().eval()
    f = cr.compile(model)
    with torch.no_grad():
        for batch in (2, 2, 3, 3, 5, 1, 2, 7, 1, 3):
            x = torch.randn(batch, 4)
            torch.testing.assert_close(f(x), model.fc(x))
    drift, small = f.recapture_reasons  # batch 1: a graph of its own; never "state changed: 'last_batch'"
    assert drift == "shape drift: input 'x' axis 0: 2 -> 3" and small.startswith("input 'x' axis 0: size 1"), small
    assert any("'last_batch' written by the target itself" in note for note in f.capture_notes)


class HooksOnce(torch.nn.Module):
    """Installs a hook on its child on its first call and keeps it, as transformers' output
    recorders do for ``output_hidden_states``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if not self.fc._forward_hooks:
            self.fc.register_forward_hook(lambda module, args, out: None)
        return self.fc(x)


def test_trap_hooks_the_target_installs_once_stay_watched_for_the_users_own():
    # They were taken for state the target writes on every call: a capture note said so, and a
    # hook the user added later on the same module was never seen.
    model = HooksOnce().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        f(x)
        f(x)
        assert f.captures[0].hits == 1 and not f.capture_notes, f.capture_notes
        model.fc.register_forward_hook(lambda module, args, out: out * 2)
        torch.testing.assert_close(f(x), model(x))
    assert f.recapture_reasons and "forward hooks" in f.recapture_reasons[-1], f.recapture_reasons


class LazyMode(torch.nn.Module):
    """Fills in a default on its first call, as HF's classification heads do with
    ``config.problem_type``."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = None

    def forward(self, x):
        if self.mode is None:
            self.mode = "double"
        return x * 2 if self.mode == "double" else x * 3


def test_trap_a_default_the_first_call_fills_in_stays_watched():
    # It was "written by the target itself" for good: the user's own change later was never seen.
    model = LazyMode()
    f = cr.compile(model)
    x = torch.ones(2)
    f(x)
    torch.testing.assert_close(f(x), torch.full((2,), 2.0))
    model.mode = "triple"
    torch.testing.assert_close(f(x), torch.full((2,), 3.0))
    torch.testing.assert_close(f(x), torch.full((2,), 3.0))
    assert f.recapture_reasons == ["state changed: 'mode'"]


class Counts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.calls  # reads what it writes: no graph can serve it


def test_trap_state_the_target_reads_and_writes_is_never_served():
    model = Counts()
    f = cr.compile(model)
    with pytest.warns(UserWarning, match=r"disagrees with eager.*the target writes 'calls' itself"):
        torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 1.0))
    for _ in range(2):
        calls = model.calls
        torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), float(calls + 1)))
    assert f.state is cr.CompiledFunction.State.Fallback


# ------------------------------------------------------------------ modules reached by functions


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4).eval()


class Pipeline:
    """A plain object holding a model, called like one (a common serving wrapper)."""

    def __init__(self) -> None:
        self.model = _linear()

    def __call__(self, x):
        return self.model(x)


class Listed(torch.nn.Module):
    """A layer kept in a plain list: not registered, so torch.export bakes it as constants."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [_linear()]

    def forward(self, x):
        return self.layers[0](x)


def _reached_targets():
    model = _linear()
    pipeline = Pipeline()
    listed = Listed().eval()
    return [
        (lambda x: model(x), model),
        (functools.partial(model), model),
        (pipeline, pipeline.model),
        (listed, listed.layers[0]),
    ]


@pytest.mark.parametrize("index", range(4), ids=["lambda", "partial", "callable-object", "plain-list"])
def test_trap_weights_of_a_model_the_target_reaches_are_watched(index):
    target, model = _reached_targets()[index]
    f = cr.compile(target)
    x = torch.ones(1, 4)
    with torch.no_grad():
        f(x)
        model.load_state_dict({k: v * 3 + 1 for k, v in model.state_dict().items()})
        torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 1 and "weights changed" in f.recapture_reasons[0]


def test_trap_a_submodule_deleted_from_a_container_is_seen():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)).eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        f(x)
        del model[1]
        torch.testing.assert_close(f(x), model(x))
    assert "submodules of the module" in f.recapture_reasons[0]


def test_trap_nested_containers_partials_and_a_functions_own_classes_are_followed():
    flags = {"head": {"negate": False}}
    f = cr.compile(functools.partial(lambda x, k: -x * k if flags["head"]["negate"] else x * k, k=2.0))
    x = torch.ones(3)
    f(x)
    flags["head"]["negate"] = True  # one level down
    torch.testing.assert_close(f(x), -x * 2)
    f.__wrapped__.keywords["k"] = 5.0  # a partial's keyword
    torch.testing.assert_close(f(x), -x * 5)
    assert f.recapture_count == 2


class _Scales(list):
    pass


class _Pair(tuple):
    pass


class _Subclassed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scales, self.pair = _Scales([2.0]), _Pair(([1.0],))

    def forward(self, x):
        return x * self.scales[0] * self.pair[0][0]


@pytest.mark.parametrize("change", ["list-subclass", "list-in-a-tuple-subclass"])
def test_trap_a_change_in_place_inside_a_container_subclass_is_seen(change):
    # A list or tuple subclass was kept by reference, not copied: changed in place, it compared
    # equal to itself and the old graph was served (a trial: 7.07 off).
    model = _Subclassed()
    f = cr.compile(model)
    x = torch.ones(3)
    with torch.no_grad():
        f(x), f(x)
        if change == "list-subclass":
            model.scales[0] = 10.0
        else:
            model.pair[0][0] = -1.0
        torch.testing.assert_close(f(x), model(x))
        f(x)
    assert f.recapture_count == 1, f.recapture_reasons  # and once seen, served again


def test_loggers_a_function_names_are_not_state():
    import logging

    log = logging.getLogger("clika_runtime_test_inert")

    def target(x):
        log.debug("called")
        return x + 1

    f = cr.compile(target)
    f(torch.ones(2))
    log.setLevel(logging.INFO)
    log.addHandler(logging.NullHandler())
    f(torch.ones(2))
    assert f.recapture_count == 0


# ------------------------------------------------------------------ found in review


class _Aux(torch.nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


AUX = _Aux()  # a module the target reaches through a global, in training mode


class _UsesAux(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(4, 4)  # "out" is an attribute name, not the global below

    def forward(self, x):
        return AUX(self.out(x))


def test_trap_a_reached_module_switched_alone_is_a_change_even_when_the_model_is_uniform():
    model = _UsesAux().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    AUX.train()
    try:
        with torch.no_grad():
            f(x)
            AUX.eval()
            torch.testing.assert_close(f(x), model(x))
    finally:
        AUX.train()
    assert f.recapture_reasons == ["state changed: 'AUX.training'"]


def test_a_global_named_like_an_attribute_the_forward_reads_is_not_watched():
    global out
    model = _UsesAux().eval()
    f = cr.compile(model)
    with torch.no_grad():
        for i in range(4):
            out = f(torch.randn(2, 4))  # a script's loop rebinding a global called like self.out
    assert f.recapture_count == 0


def test_trap_a_swap_in_a_long_module_list_is_seen():
    model = torch.nn.Sequential(*[torch.nn.ReLU() for _ in range(70)])
    f = cr.compile(model)
    x = torch.randn(3)
    f(x)
    model[1] = torch.nn.Tanh()  # no parameters: only the list of children moved
    torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 1


def test_a_closure_that_writes_one_variable_keeps_the_others_watched():
    calls, scale = 0, 2.0

    def target(x):
        nonlocal calls
        calls += 1
        return x * scale

    f = cr.compile(target)
    x = torch.ones(3)
    f(x)
    scale = 5.0
    torch.testing.assert_close(f(x), x * 5)
    assert f.recapture_reasons == ["state changed: closed-over 'scale'"]


class _Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        chain: tuple = ()
        for i in range(3000):
            chain = (i, chain)
        self.chain = chain  # deeper than any walk
        self.registry: dict = {}
        self.registry["all"] = self.registry  # holds itself

    def forward(self, x):
        return self.fc(x)


def test_attributes_too_deep_to_walk_never_reach_the_caller():
    model = _Odd().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad(), pytest.warns(UserWarning, match="serves eagerly"):  # torch.export cannot either
        for _ in range(2):
            torch.testing.assert_close(f(x), model(x))


def test_big_nested_containers_are_watched_by_identity_not_copied():
    cube = [[[0] * 64 for _ in range(64)] for _ in range(64)]
    small = {"a": [1, 2], "b": {"c": 3}}
    assert kept(cube) is cube
    copy = kept(small)
    assert copy == small and copy is not small and copy["b"] is not small["b"]


def test_a_hook_made_elsewhere_costs_one_look_and_no_capture():
    model, f, x = _knobs()
    other = torch.zeros(3, requires_grad=True)
    with torch.no_grad():
        for _ in range(3):
            other.register_hook(lambda grad: grad).remove()  # torch counts every handle made
            torch.testing.assert_close(f(x), model(x))
    table = f._lifecycle.table
    with torch.no_grad():
        assert f.recapture_count == 0 and table.fresh() and table.snapshot.changed() == []


_HISTORY: list = []
_LAST: dict = {}


def _scored(x):
    y = x.softmax(-1)
    _HISTORY.append(y.amax(-1))  # a per-call log of confidences, the last batch kept for debugging
    _LAST["y"] = y
    return y


def test_trap_the_capture_leaves_no_fake_tensor_in_what_the_target_writes():
    """The export runs the target's Python again over fake tensors: its append to a global list
    and its write to a global dict left a FakeTensor there (using it raised) beside the eager
    call's own entries."""
    _HISTORY.clear(), _LAST.clear()
    f = cr.compile(_scored)
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = f(x)
    assert len(_HISTORY) == 1 and type(_HISTORY[0]) is torch.Tensor and type(_LAST["y"]) is torch.Tensor
    torch.testing.assert_close(_LAST["y"], y)
    torch.testing.assert_close(torch.stack(_HISTORY), y.amax(-1)[None])


def test_trap_a_hook_that_keeps_activations_gets_no_fake_tensor_and_is_said():
    """Feature extraction (``layer.register_forward_hook(lambda m, i, o: feats.__setitem__(...))``):
    the export's trace left a FakeTensor in the hook's dict, and served calls (which run no hook)
    left it stale, silently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    feats: dict = {}
    model[0].register_forward_hook(lambda module, args, out: feats.__setitem__("first", out))
    f = cr.compile(model)
    x = torch.randn(3, 4)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"forward hooks on '0' keep what they see"):
        f(x)
    assert type(feats["first"]) is torch.Tensor  # the eager call's, not the trace's
    torch.testing.assert_close(feats["first"], torch.nn.functional.linear(x, model[0].weight, model[0].bias))


class _Counted(torch.nn.Module):
    """A head whose forward reads ``scale`` (through a property) and ``mode`` (and ``alpha`` or
    ``beta`` by it), and ``bias`` through ``getattr`` with a default; ``requests`` and
    ``last_latency`` are the caller's bookkeeping, never read by a call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self._scale, self.mode, self.alpha, self.beta = 2.0, "a", 1.0, 1.0
        self.requests, self.last_latency = 0, 0.0

    @property
    def scale(self) -> float:
        return self._scale

    def forward(self, x):
        y = self.fc(x) * self.scale * (self.alpha if self.mode == "a" else self.beta)
        return y + getattr(self, "bias", 0.0)


def _counted() -> tuple[_Counted, cr.CompiledFunction, torch.Tensor]:
    return _captured(_Counted(), calls=1)


def test_trap_bookkeeping_the_call_never_reads_is_not_a_change_of_state():
    """A request counter and the last latency kept on the module (or on the object a compiled
    method is bound to) between calls: each change re-captured (seconds of export), nothing was
    ever served, and after eight the function served eagerly for good."""
    model, f, x = _counted()
    with torch.no_grad():
        for i in range(10):
            model.requests += 1
            model.last_latency = 0.1 * i
            torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 0 and sum(c.hits for c in f.captures) == 10


def test_trap_what_the_call_reads_stays_watched_when_bookkeeping_is_not():
    model, f, x = _counted()
    changes = [lambda: setattr(model, "_scale", 3.0),  # behind a property
               lambda: setattr(model, "alpha", 0.5),
               lambda: setattr(model, "mode", "b"),  # now beta is read
               lambda: setattr(model, "beta", 4.0),
               lambda: setattr(model, "bias", 1.0)]  # asked for (with a default) before it existed
    with torch.no_grad():
        for count, change in enumerate(changes, start=1):
            change()
            torch.testing.assert_close(f(x), model(x))
            assert f.recapture_count == count
            torch.testing.assert_close(f(x), model(x))  # and served again
    assert f.recapture_count == len(changes)


def test_trap_bookkeeping_on_the_object_a_compiled_method_is_bound_to_is_not_a_change():
    class Service:
        def __init__(self) -> None:
            self.factor, self.requests = 2.0, 0

        @cr.compile
        def score(self, x):
            return x * self.factor

        def handle(self, x):
            self.requests += 1
            return self.score(x)

    service, x = Service(), torch.ones(3)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(service.handle(x), x * 2)
        service.factor = 3.0
        torch.testing.assert_close(service.handle(x), x * 3)
    assert service.score.recapture_count == 1 and "factor" in service.score.recapture_reasons[0]


class _ByDict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = 2.0

    def forward(self, x):
        return x * vars(self)["gain"]  # not through attribute access: the object is watched whole


def test_trap_a_forward_reading_its_own_dict_keeps_every_attribute_watched():
    model = _ByDict().eval()
    f = cr.compile(model)
    x = torch.ones(3)
    with torch.no_grad():
        f(x)
        model.gain = 5.0
        torch.testing.assert_close(f(x), x * 5)
    assert f.recapture_count == 1


class _Gate(torch.nn.Module):
    """A forward that checks its own class, pickles its config, deletes a private attribute once,
    reads an attribute through object.__getattribute__ and one of a deep copy."""

    registry: dict = {}

    def __init_subclass__(cls, **kwargs):  # a plugin registry by name, wrapping each forward
        super().__init_subclass__(**kwargs)
        _Gate.registry[cls.__name__] = cls

    def __init__(self) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(scale=2.0)
        self.k, self._once = 3.0, True

    def forward(self, x):
        if "_once" in vars(self):  # lazy set-up, once (nn.LazyLinear deletes its hooks so)
            del self._once
        y = x * self.k if type(self) is _Gate else x - self.k
        y = y * object.__getattribute__(self, "k")
        return y * copy.deepcopy(self.cfg).scale + len(pickle.dumps(self.cfg)) * 0


def test_trap_watching_what_a_capture_reads_leaves_the_users_classes_alone():
    """Noting reads by giving each object a subclass for the run: ``type(self) is Gate`` went
    False (wrong answers, in other threads too), ``__init_subclass__`` registered the subclass,
    pickling the config raised, a forward deleting a private attribute broke the capture, and
    reads through ``object.__getattribute__`` or a deep copy went unwatched (served stale)."""
    model, f, x = _captured(_Gate())
    assert set(_Gate.registry) == set() and type(model) is _Gate
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))
        assert sum(c.hits for c in f.captures) >= 1
        for change in (lambda: setattr(model, "k", 5.0), lambda: setattr(model.cfg, "scale", 7.0)):
            change()
            torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 2


class _Stats(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.stats = types.SimpleNamespace(requests=0, last_latency=0.0)  # the caller's
        self.opts = types.SimpleNamespace(scale=2.0, calls=0)  # scale read, calls the caller's

    def forward(self, x):
        return self.fc(x) * self.opts.scale


def test_trap_bookkeeping_in_a_namespace_the_call_never_reads_is_not_a_change():
    model, f, x = _captured(_Stats())
    with torch.no_grad():
        for i in range(4):
            model.stats.requests += 1
            model.opts.calls += 1
            torch.testing.assert_close(f(x), model(x))
        model.opts.scale = 3.0
        torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 1


class _Cached(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._scale = 2.0

    @functools.cached_property
    def unit(self) -> float:
        return 1.0

    def forward(self, x):
        return x * self._scale * self.unit


def test_trap_a_private_attribute_read_beside_a_cached_property_stays_watched():
    model, f, x = _captured(_Cached())
    with torch.no_grad():
        model._scale = 5.0
        torch.testing.assert_close(f(x), model(x))
    assert f.recapture_count == 1


class _LogitScaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))  # CLIP's

    def forward(self, x):
        return self.fc(x) * self.logit_scale.exp()


def _averaged() -> torch.nn.Module:
    from torch.optim.swa_utils import AveragedModel

    return AveragedModel(torch.nn.Linear(8, 4))


@pytest.mark.parametrize("make", [_LogitScaled, _averaged, lambda: torch.nn.Sequential(
    torch.nn.Linear(8, 8), torch.nn.PReLU(), torch.nn.Linear(8, 4))], ids=["0-d parameter", "AveragedModel", "PReLU"])
def test_trap_a_model_with_a_one_element_tensor_is_captured(make):
    """Telling what the target writes itself compares the watched state as each trace returns,
    while the export has the parameters swapped for fake tensors: a dictionary compare reached a
    one-element fake's ``bool()``, which left an unbacked size pending, and every capture of CLIP
    (``logit_scale``), ``nn.PReLU()`` or ``AveragedModel`` (``n_averaged``) failed."""
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(5, 8)
    f = cr.compile(model)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert sum(c.hits for c in f.captures) == 2, f.fallback_reason


class _Scaled(torch.autograd.Function):
    SCALE = 2.0

    @staticmethod
    def forward(ctx, x):
        return x * _Scaled.SCALE

    @staticmethod
    def backward(ctx, grad):
        return grad * _Scaled.SCALE


class _UsesFunction(torch.nn.Module):
    def forward(self, x):
        return _Scaled.apply(x)


class _Relu(torch.nn.Module):
    def forward(self, x):
        return x.relu()


def test_trap_a_forward_rewritten_on_its_class_is_followed():
    # An FX pass then gm.recompile() writes a new forward into the GraphModule's class: the old
    # graph was served (found by a trial); so was a forward replaced on the model's own class.
    gm = torch.fx.symbolic_trace(_Relu().eval())
    f = cr.compile(gm)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        f(x)
        for node in gm.graph.nodes:
            if node.op == "call_method" and node.target == "relu":
                node.target = "sigmoid"
        gm.recompile()
        torch.testing.assert_close(f(x), x.sigmoid())

    class Local(torch.nn.Module):
        def forward(self, x):
            return x.relu()

    g = cr.compile(Local().eval())
    with torch.inference_mode():
        g(x)
        Local.forward = lambda self, x: x.tanh()
        torch.testing.assert_close(g(x), x.tanh())


def test_trap_a_class_the_forward_names_has_its_settings_watched():
    # _Scaled.SCALE read inside a custom autograd.Function the forward names: changed, the old
    # graph was served (found by a trial).
    f = cr.compile(_UsesFunction().eval())
    x = torch.randn(3)
    try:
        with torch.inference_mode():
            f(x)
            _Scaled.SCALE = 4.0
            torch.testing.assert_close(f(x), x * 4.0)
    finally:
        _Scaled.SCALE = 2.0


SCALE = 2.0
ENCODER = torch.nn.Linear(4, 4)


class _NoGradForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    @torch.no_grad()
    def forward(self, x):
        return self.fc(x) * SCALE


class _InferenceForward(_NoGradForward):
    @torch.inference_mode()
    def forward(self, x):
        return ENCODER(self.fc(x))


def _embed(x):  # a helper the target calls: its global model
    return ENCODER(x)


def _timed(fn):  # a decorator without functools.wraps
    def wrapper(*args):
        return fn(*args)
    return wrapper


@_timed
def _scaled(x):
    return x * SCALE


_BEHIND = {
    "a global read by a decorated forward": (_NoGradForward, lambda: _set_scale(5.0)),
    "a global model called by a decorated forward": (_InferenceForward, lambda: ENCODER.weight.mul_(2)),
    "a global model called by a helper": (lambda: lambda x: _embed(x) + 1, lambda: ENCODER.weight.mul_(2)),
    "a global read behind a decorator without wraps": (lambda: _scaled, lambda: _set_scale(5.0)),
}


def _set_scale(value):
    global SCALE
    SCALE = value


@pytest.mark.parametrize("name", _BEHIND)
def test_trap_state_read_behind_a_decorator_or_a_helper_is_followed(name):
    # A forward decorated with @torch.no_grad() was watched through torch's wrapper: the globals
    # and models the user's forward reads went unseen, and after a change the old graph served
    # (a trial). So were models a helper function reaches through a global.
    make, change = _BEHIND[name]
    target = make()
    target = target.eval() if isinstance(target, torch.nn.Module) else target
    f = cr.compile(target)
    x = torch.randn(3, 4)
    saved = ENCODER.weight.detach().clone()
    try:
        with torch.no_grad():
            f(x), f(x)
            change()
            torch.testing.assert_close(f(x), target(x))
    finally:
        _set_scale(2.0)
        with torch.no_grad():
            ENCODER.weight.copy_(saved)
