"""Nothing stale: weights, buffers, closed-over tensors and static objects are what the target
would use now, on every call; a shipped graph keeps the guard its capture enforced."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from conftest import Counted

import clika_runtime as cr
from clika_runtime import GraphInputError

State = cr.CompiledFunction.State


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.zeros(3))

    def forward(self, x):
        return self.fc(x) + self.shift


def _served_and_eager(f, model, x):
    with torch.no_grad():
        return f(x), model(x)


@pytest.mark.parametrize(
    "change, changed",
    [
        (lambda m: m.load_state_dict({k: v * 2 + 1 for k, v in m.state_dict().items()}), "'fc.weight'"),
        (lambda m: m.fc.weight.mul_(3), "'fc.weight'"),
        (lambda m: m.shift.add_(1), "'shift'"),
        (lambda m: setattr(m.fc.weight, "data", torch.randn(3, 4)), "'fc.weight'"),
        (lambda m: setattr(m.fc, "bias", torch.nn.Parameter(torch.ones(3))), "'fc.bias'"),
        (lambda m: setattr(m, "fc", torch.nn.Linear(4, 3)), "'fc.weight'"),
        (lambda m: m.half().float(), "'fc.weight'"),  # new storage, possibly at the old address
    ],
    ids=["load_state_dict", "inplace_param", "inplace_buffer", "param_data", "new_parameter", "new_submodule",
         "half_float"],
)
def test_changed_weights_are_never_served_stale(change, changed):
    model = Net().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    _served_and_eager(f, model, x)
    with torch.no_grad():
        change(model)
    got, expected = _served_and_eager(f, model, x)
    torch.testing.assert_close(got, expected)
    assert f.recapture_count == 1 and f.recapture_reasons[0].startswith("weights changed:")
    assert changed in f.recapture_reasons[0], f.recapture_reasons
    got, expected = _served_and_eager(f, model, x)  # and the new graph serves from then on
    torch.testing.assert_close(got, expected)
    assert f.recapture_count == 1 and f.state is State.Compiled


@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_trap_a_fused_optimizers_step_is_seen(optimizer):
    """torch's fused optimizers (``fused=True``) write the parameters through their kernels'
    pointers and move no version counter: the graph served the weights of before the step."""
    model = Net().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    _served_and_eager(f, model, x)
    step = getattr(torch.optim, optimizer)(model.parameters(), lr=0.1, fused=True)
    for _ in range(2):  # the second step changes a capture made after the first
        model(x).sum().backward()
        step.step()
        step.zero_grad()
        got, expected = _served_and_eager(f, model, x)
        torch.testing.assert_close(got, expected)
    assert f.recapture_count == 2 and all(r.startswith("weights changed:") for r in f.recapture_reasons)


def test_an_optimizer_step_that_moves_nothing_keeps_the_graph():
    """Parameters without a gradient are not stepped: the graph stays."""
    model = Net().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    _served_and_eager(f, model, x)
    torch.optim.Adam(model.parameters(), fused=True).step()  # no gradients yet
    got, expected = _served_and_eager(f, model, x)
    torch.testing.assert_close(got, expected)
    assert f.recapture_count == 0


def test_trap_parameters_stay_swappable_after_a_capture():
    """torch's export left its last trace reachable from a global (the fake tensors' describer
    holds a weak reference to each parameter), and ``torch.utils.swap_tensors`` refuses a tensor
    with a weak reference: ``model.double()`` under ``torch.__future__.set_swap_module_params_on_
    conversion(True)`` raised after a capture. A swap is a weights change like any other."""
    model = Net().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    _served_and_eager(f, model, x)
    torch.utils.swap_tensors(model.fc.weight, torch.nn.Parameter(torch.randn(3, 4)))
    got, expected = _served_and_eager(f, model, x)
    torch.testing.assert_close(got, expected)
    assert f.recapture_reasons and "'fc.weight'" in f.recapture_reasons[-1]


_NESTED_CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}),
    "in place": lambda m: m.weight.mul_(2),
    "attribute": lambda m: setattr(m, "scale", 5.0),
    "forward hook": lambda m: m.register_forward_hook(lambda mod, args, out: out * 3),
}


class _Scaled(torch.nn.Linear):
    scale = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("change", _NESTED_CHANGES)
def test_trap_a_compiled_function_calling_another_sees_its_models_changes(change):
    """A pipeline compiled around a separately compiled backbone baked the backbone's weights,
    attributes and hooks, but watched none of them: after a new checkpoint it served the old."""
    torch.manual_seed(0)
    model = _Scaled(4, 4).eval()
    inner = cr.compile(model)

    def outer(x):
        return inner(x) * 2 + 1

    f = cr.compile(outer)
    for got, want in _after_a_change(f, outer, lambda: _NESTED_CHANGES[change](model), torch.randn(3, 4)):
        torch.testing.assert_close(got, want)
    assert f.recapture_count == 1, f.recapture_reasons


def _after_a_change(f: cr.CompiledFunction, eager, change, x) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``f(x)`` captured and served, then ``change()``: two calls' (``f(x)``, ``eager(x)``) pairs."""
    with torch.no_grad():
        f(x), f(x)
        change()
        return [(f(x), eager(x)) for _ in range(2)]


def test_an_unrelated_registration_keeps_the_graph():
    model = Net().eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    _served_and_eager(f, model, x)
    torch.nn.Linear(2, 2)  # registers parameters somewhere else in the process
    got, expected = _served_and_eager(f, model, x)
    torch.testing.assert_close(got, expected)
    assert f.recapture_count == 0


class _Slots(torch.nn.Module):
    """A linear without a bias, tied to an embedding, an optional buffer, a buffer read if present."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.fc = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight  # tie_weights()
        self.register_buffer("extra", None)

    def forward(self, ids):
        y = self.fc(self.emb(ids))
        y = y + self.extra if self.extra is not None else y
        y = y * self.late if hasattr(self, "late") else y
        return self.head(y)


def _direct_write(m: _Slots) -> None:  # accelerate's set_module_tensor_to_device, torch's member accessor
    m.fc._parameters["weight"] = torch.nn.Parameter(torch.randn(4, 4))


_SLOT_CHANGES = {
    "a bias where there was none": lambda m: setattr(m.fc, "bias", torch.nn.Parameter(torch.full((4,), 3.0))),
    "a None buffer filled": lambda m: setattr(m, "extra", torch.full((4,), 3.0)),
    "a buffer registered later": lambda m: m.register_buffer("late", torch.full((4,), 2.0)),
    "tied weights untied": lambda m: setattr(m.head, "weight", torch.nn.Parameter(torch.randn(6, 4))),
    "a parameter written into _parameters": _direct_write,
}


@pytest.mark.parametrize("change", _SLOT_CHANGES)
def test_trap_a_parameter_or_buffer_slot_changed_after_capture_is_seen(change):
    """Each served the graph of before: a slot that was ``None`` (or absent) given a tensor, a
    tied weight given its own, a parameter written straight into ``_parameters`` (no torch hook
    runs for that)."""
    torch.manual_seed(0)
    model = _Slots().eval()
    f = cr.compile(model)
    for got, want in _after_a_change(f, model, lambda: _SLOT_CHANGES[change](model), torch.randint(0, 6, (2, 5))):
        torch.testing.assert_close(got, want)
    assert f.recapture_count == 1 and f.captures[0].hits == 1, f.recapture_reasons  # re-captured, then served


def test_trap_functional_call_through_a_compiled_forward_uses_the_parameters_passed():
    torch.manual_seed(0)
    model = Net().eval()
    model.forward = cr.compile(model.forward)
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x), model(x)
        params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
        got = torch.func.functional_call(model, params, (x,))
        torch.testing.assert_close(got, x @ params["fc.weight"].T + params["fc.bias"] + model.shift)
        torch.testing.assert_close(model(x), model.fc(x) + model.shift)  # and its own again after
    captures = model.forward.captures  # the lent parameters' call ran eagerly; the graph stayed
    assert model.forward.recapture_count == 0 and len(captures) == 1 and captures[0].hits == 2


SCALE = torch.tensor([2.0, 3.0])


def _scaled(x):
    return x * SCALE


def test_closed_over_tensors_changed_in_place_or_rebound_recapture():
    global SCALE
    table = torch.tensor([1.0, 1.0])
    f = cr.compile(lambda x: x * table)
    x = torch.ones(2)
    f(x)
    table.mul_(5)
    torch.testing.assert_close(f(x), x * table)
    assert f.recapture_reasons == ["weights changed: 'table'"]
    g = cr.compile(_scaled)
    g(x)
    saved, SCALE = SCALE, torch.tensor([7.0, 7.0])
    try:
        torch.testing.assert_close(g(x), torch.full((2,), 7.0))
        assert g.recapture_reasons == ["weights changed: 'SCALE'"]
    finally:
        SCALE = saved


class Config:
    def __init__(self, scale):
        self.scale = scale


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float
    mode: str = "mul"


def test_a_mutable_static_object_is_keyed_by_its_value_not_its_identity():
    target = Counted(lambda x, cfg: x * cfg.scale)
    f = cr.compile(target)
    cfg, x = Config(2.0), torch.ones(3)
    torch.testing.assert_close(f(x, cfg), x * 2)
    cfg.scale = 3.0
    torch.testing.assert_close(f(x, cfg), x * 3)
    assert f.recapture_count == 1 and "static value changed: 'cfg'" in f.recapture_reasons[0]
    calls = target.calls
    torch.testing.assert_close(f(x, Config(3.0)), x * 3)  # an equal object hits
    assert target.calls == calls


def test_a_frozen_dataclass_equal_to_the_captured_one_hits():
    target = Counted(lambda x, cfg: x * cfg.scale if cfg.mode == "mul" else x + cfg.scale)
    f = cr.compile(target)
    x = torch.ones(3)
    f(x, Frozen(2.0))
    calls = target.calls
    torch.testing.assert_close(f(x, Frozen(2.0)), x * 2)
    assert target.calls == calls
    torch.testing.assert_close(f(x, Frozen(2.0, "add")), x + 2)
    assert f.recapture_count == 1


def test_an_object_that_cannot_be_compared_by_value_serves_eagerly_with_one_warning():
    class Holder:
        def __init__(self):
            self.weights = torch.ones(3)

    f = cr.compile(lambda x, h: x * h.weights)
    h, x = Holder(), torch.ones(3)
    with pytest.warns(UserWarning, match="holding a Tensor") as record:
        f(x, h)
        h.weights = torch.full((3,), 2.0)
        torch.testing.assert_close(f(x, h), x * 2)
    # Nothing will serve such calls: the state says so, and why (a new key may still capture).
    assert len(record) == 1 and f.state is State.Fallback and "holding a Tensor" in f.fallback_reason


# --------------------------------------------------------------------------------- shipped guards


def _above_two(x):
    return x * 2 if x.shape[0] > 2 else x + 1


@pytest.fixture(scope="module")
def shipped_branch(tmp_path_factory):
    f = cr.compile(_above_two)
    f(torch.ones(4, 2))
    f(torch.ones(6, 2))  # axis 0 dynamic; the branch holds for sizes >= 3 only
    path = f.take_graph().save(tmp_path_factory.mktemp("guard") / "branch.onnx")
    return f, path


def test_a_shipped_graph_enforces_the_guard_its_capture_enforced(shipped_branch):
    _, path = shipped_branch
    served = cr.load(path)
    np.testing.assert_array_equal(served(np.ones((5, 2), np.float32)), np.full((5, 2), 2.0, np.float32))
    with pytest.raises(GraphInputError, match=r"input 'x' axis 0: size 2 outside the graph's range \[3, inf\]"):
        served(np.ones((2, 2), np.float32))
    with pytest.raises(GraphInputError, match=r"input 'x' axis 0: size 1 outside the graph's range \[3, inf\]"):
        served(np.ones((1, 2), np.float32))


def test_inspect_shows_the_guard(shipped_branch, capsys):
    from clika_runtime.cli import main as cli

    _, path = shipped_branch
    assert cli(["inspect", str(path)]) == 0
    assert "x_dim0 in [3, inf]" in capsys.readouterr().out


def test_graphs_from_other_tools_load_without_a_shipped_guard(tmp_path):
    from onnx import TensorProto, helper, save

    node = helper.make_node("Relu", ["a"], ["b"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 2])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 2])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "relu.onnx"))
    served = cr.load(tmp_path / "relu.onnx")
    assert served(np.ones((1, 2), np.float32))["b"].shape == (1, 2)
    with pytest.raises(GraphInputError, match=r"input 'a' axis 1: expected size 2, got 3"):
        served(np.ones((1, 3), np.float32))


def test_tensors_made_under_inference_mode_are_named_in_a_capture_note():
    with torch.inference_mode():
        shift = torch.ones(4)  # keeps no version counter: its in-place updates cannot be seen
    f = cr.compile(lambda x: x + shift)
    f(torch.ones(4))
    assert any("'shift' is an inference tensor" in note for note in f.capture_notes), f.capture_notes


def _limited():
    class Limited(torch.nn.Module):
        LIMIT = 0.5  # a class-body setting: read as self.LIMIT or type(self).LIMIT

        def forward(self, x):
            return torch.clamp(x, max=self.LIMIT) + torch.clamp(x, min=type(self).LIMIT)

    return Limited


def _settings():
    class Settings:
        LIMIT = 0.5

    return Settings


class _Configured(torch.nn.Module):
    def __init__(self, settings) -> None:
        super().__init__()
        self.settings = settings

    def forward(self, x):
        return torch.clamp(x, max=self.settings.LIMIT)


@pytest.mark.parametrize("held", ["the module's class", "a config object's class"])
def test_trap_a_class_attribute_changed_after_capture_recaptures(held):
    """A class-body value changed after the capture (``Limited.LIMIT = 2.0``, read through the
    module or an object it holds): the graph kept 0.5 and served it."""
    if held == "the module's class":
        cls = _limited()
        model = cls()
    else:
        cls = _settings()
        model = _Configured(cls())
    f = cr.compile(model)
    x = torch.full((2,), 10.0)
    _served_and_eager(f, model, x)
    cls.LIMIT = 2.0
    got, expected = _served_and_eager(f, model, x)
    torch.testing.assert_close(got, expected)
    assert f.recapture_count == 1 and "LIMIT" in f.recapture_reasons[-1], f.recapture_reasons
    got, expected = _served_and_eager(f, model, x)
    torch.testing.assert_close(got, expected)
    assert f.captures[-1].hits >= 1  # served again from the new capture


def test_trap_a_model_converted_under_inference_mode_is_served():
    """Deploy code converts under ``torch.inference_mode()`` (``model.half().float()``,
    ``.to(device)``): its parameters became inference tensors that still require grad, which
    torch.export refused to trace, and the function served eagerly for good."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    with torch.inference_mode():
        model.to(torch.float64).to(torch.float32)
    f = cr.compile(model)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert f.state is State.Compiled and sum(c.hits for c in f.captures) == 2
    assert all(p.requires_grad for p in model.parameters())  # as the user left them


# ---------------------------------------------------- models a function reaches in less usual places
# A function using a model it reaches outside a closure cell or a plain global: each was served the
# graph of the weights it was captured with after the model changed (a new-user trial).

_Pair = __import__("collections").namedtuple("_Pair", "student teacher")
_PAIR = _Pair(torch.nn.Linear(4, 3).eval(), torch.nn.Linear(4, 3).eval())
_REGISTRY = type("_Registry", (), {})()
_REGISTRY.groups = {"ensemble": [torch.nn.Linear(4, 3).eval(), torch.nn.Linear(4, 3).eval()]}


class _Head:
    """A plain callable object holding a model (not a module)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        return self.model(x).softmax(-1)


_HEADS = {"intent": _Head(torch.nn.Linear(4, 3).eval())}


class _Service:
    MODEL = torch.nn.Linear(4, 3).eval()

    @classmethod
    def infer(cls, x):
        return cls.MODEL(x) * 2


def _make_encoder(model):
    def encode(x):
        return model(x)
    return encode


_ENCODE = _make_encoder(torch.nn.Linear(4, 3).eval())


def _embed(x):
    return torch.nn.functional.normalize(_ENCODE(x), dim=-1)


def _reached_forms():
    positional = torch.nn.Linear(4, 3).eval()
    keyword = torch.nn.Linear(4, 3).eval()

    def by_default(x, model=positional):
        return model(x)

    def by_keyword_default(x, *, model=keyword):
        return model(x)

    return {
        "default argument": (by_default, positional),
        "keyword-only default": (by_keyword_default, keyword),
        "named tuple": (lambda x: _PAIR.teacher(x) - _PAIR.student(x), _PAIR.teacher),
        "object, dict, list": (lambda x: sum(m(x) for m in _REGISTRY.groups["ensemble"]),
                               _REGISTRY.groups["ensemble"][1]),
        "callable object in a dict": (lambda x: _HEADS["intent"](x), _HEADS["intent"].model),
        "class attribute of a classmethod": (_Service.infer, _Service.MODEL),
        "closure of a global helper": (_embed, _ENCODE.__closure__[0].cell_contents),
    }


@pytest.mark.parametrize("form", list(_reached_forms()))
def test_trap_a_model_reached_outside_a_closure_or_global_is_watched(form):
    fn, model = _reached_forms()[form]
    f = cr.compile(fn)
    x = torch.randn(2, 4)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(x)
        f(x)
        for write in (lambda w: w.mul_(-2.0), lambda w: w.copy_(torch.randn(3, 4))):  # a step, an EMA update
            with torch.inference_mode(False), torch.no_grad():
                write(model.weight)
            for _ in range(2):
                torch.testing.assert_close(f(x), fn(x))


_NESTED = [[[i * j * k for k in range(60)] for j in range(60)] for i in range(60)]


def test_trap_a_global_of_nested_small_lists_is_not_walked_item_by_item(monkeypatch):
    """Finding models past the object depth walked every item of nested small containers: a
    60 x 60 x 60 list of numbers the target read cost 219,666 visits a walk (a third of a second
    each miss). The search past that depth is bounded."""
    from clika_runtime.state import walk

    visits = [0]
    held = walk._held

    def counted(*args, **kwargs):
        visits[0] += 1
        return held(*args, **kwargs)

    monkeypatch.setattr(walk, "_held", counted)
    walk.parts_read(lambda x: x * len(_NESTED), None)
    assert visits[0] < 5000, visits[0]  # those at the object depth, and a bounded search past it
