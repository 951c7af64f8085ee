"""Unit tests of the pure parts of the lifecycle: the key (``key.py``) and capture planning
(``planning.py``), on plain data, without exporting anything."""

from __future__ import annotations

import dataclasses
import enum
import math
from types import MappingProxyType, SimpleNamespace

import pytest
import torch

from clika_runtime.base.config import config
from clika_runtime.capture.plan import Call, CapturePlan, Knowledge, Options
from clika_runtime.function.planning import Eager, GiveUp, decide
from clika_runtime.function.table import CacheTable, State
from clika_runtime.guards.guard import Guard, InputRule, Verified
from clika_runtime.trees.calls import CallForms
from clika_runtime.trees.key import CallKey, Described, Unkeyable, closest, explain, static_value

# ---------------------------------------------------------------------------------------- the key


class Mode(enum.Enum):
    A = "a"


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float


class Mutable:
    def __init__(self, scale):
        self.scale = scale


class Bag:
    def __init__(self, **attributes):
        vars(self).update(attributes)


def test_static_values_key_by_type_and_value():
    assert static_value(1) != static_value(1.0) != static_value(True)
    assert static_value(math.nan) == static_value(math.nan)
    assert static_value(0.0) != static_value(-0.0)
    assert static_value(Mode.A) == static_value(Mode.A)
    assert static_value(Frozen(2.0)) == static_value(Frozen(2.0)) != static_value(Frozen(3.0))
    assert static_value(torch.float16) == static_value(torch.float16)
    assert static_value(len) == static_value(len)  # code keys by identity


def test_a_mutable_object_keys_by_a_snapshot_taken_on_every_call():
    cfg = Mutable(2.0)
    before = static_value(cfg)
    cfg.scale = 3.0
    assert static_value(cfg) != before and static_value(cfg) == static_value(Mutable(3.0))


@pytest.mark.parametrize("leaf, message", [
    (Bag(weights=torch.ones(1)), "holding a Tensor"),
    (type("Opaque", (), {"__hash__": None})(), "unhashable type Opaque"),
    (torch.nn.Linear(1, 1), "Linear passed where only tensor leaves feed the graph"),
    (Bag(items=list(range(100))), "too large"),
])
def test_what_cannot_key_a_capture_says_why(leaf, message):
    with pytest.raises(Unkeyable, match=message):
        static_value(leaf)


def _described(statics, tensors=((torch.float32, 2, torch.device("cpu")),), structure="s", paths=("x", "mode")):
    key = CallKey(structure, tuple(static_value(s) for s in statics), tuple(tensors), None)
    return Described(key, paths, paths[len(tensors):], paths[: len(tensors)])


def test_explain_names_the_first_difference():
    a = _described(["a"])
    assert explain(a, _described(["b"])) == "static value changed: 'mode' 'a' -> 'b'"
    double = ((torch.float64, 2, torch.device("cpu")),)
    assert explain(a, _described(["a"], double)) == "input 'x' changed: float32 rank 2 on cpu -> float64 rank 2 on cpu"
    grown = _described(["a"], structure="t", paths=("x", "mode", "mask"))
    assert explain(a, grown) == "new structure: 'mask' appeared"


def test_a_miss_is_explained_against_the_closest_key():
    first, second = _described(["a"]), _described(["a"], ((torch.float64, 2, torch.device("cpu")),))
    call = _described(["b"])
    assert closest([first, second], call.key) is first


# ------------------------------------------------------------------------------------------ planning


def _call(*args, options=Options(), knowledge=Knowledge(), **kwargs):
    def target(x, mode="a", y=None):
        return x

    return Call(CallForms(target), args, kwargs, None, knowledge, options)


class _Capture(SimpleNamespace):
    """What the planner reads of a capture (a plan points at captures weakly, as at real ones)."""


def _capture(call, shape, ranges=(), conditions=(), verified=(), dynamic=None):
    rules = tuple(InputRule(n, "float32", s) for n, s in zip(call.names, shape))
    return _Capture(key=call.key, guard=Guard(rules, ranges, conditions, verified, device="cpu",
                                              verify_small=True),
                    dynamic=dynamic or tuple({} for _ in call.names), described=call.described,
                    example=(), stats=SimpleNamespace(last_use=0.0))


def _table(*captures, recaptures=0, knowledge=Knowledge(), spent=()):
    entries = {}
    for c in captures:
        entries[c.key] = entries.get(c.key, ()) + (c,)
    return CacheTable(state=State.Compiled, entries=MappingProxyType(entries), recaptures=recaptures,
                      knowledge=knowledge, last=captures[-1].described if captures else None, spent=spent)


def test_the_first_call_plans_a_capture_without_a_reason():
    call = _call(torch.ones(2, 3), options=Options(dynamic=True))
    plan = decide(CacheTable(), call, Options(dynamic=True), None)
    assert isinstance(plan, CapturePlan) and plan.reason is None
    assert plan.dynamic == ({0: None, 1: None},)


def test_a_static_size_drift_plans_the_axis_dynamic():
    first = _call(torch.ones(2, 3))
    table = _table(_capture(first, [(2, 3)]))
    plan = decide(table, _call(torch.ones(5, 3)), Options(), None)
    assert isinstance(plan, CapturePlan) and plan.dynamic == ({0: None},)
    assert plan.reason == "shape drift: input 'x' axis 0: 2 -> 5"


def test_sizes_below_two_on_a_dynamic_axis_get_a_variant_traced_at_them():
    first = _call(torch.ones(4, 3))
    table = _table(_capture(first, [("x_dim0", 3)], dynamic=({0: None},)))
    plan = decide(table, _call(torch.ones(1, 3)), Options(), None)
    assert isinstance(plan, CapturePlan) and plan.variant and not plan.spends
    assert plan.reason == "input 'x' axis 0: size 1, which the trace assumed away (torch.export traces dynamic sizes from 2)"
    assert plan.dynamic == ({},)  # axis 0 at size 1 goes static


def test_a_flipped_condition_gets_a_variant_unless_a_point_covers_it():
    first = _call(torch.ones(4, 3))
    condition = ((("eq", ("size", 0, 0), ("const", 4)), False),)
    capture = _capture(first, [("x_dim0", 3)], conditions=condition, dynamic=({0: None},))
    plan = decide(_table(capture), _call(torch.ones(4, 3)), Options(), None)
    assert isinstance(plan, CapturePlan) and plan.variant and "x.shape[0] == 4 was False, now True" in plan.reason
    traced_there = _capture(first, [("x_dim0", 3)], conditions=condition, dynamic=({0: None},),
                            verified=(Verified((("x_dim0", 4),), (True,)),))  # the capture's own example
    assert decide(_table(traced_there), _call(torch.ones(4, 3)), Options(), None).capture is traced_there


def test_the_budget_gives_up_with_the_last_reason_and_what_spent_it():
    first = _call(torch.ones(2, 3))
    spent = ("shape drift: input 'x' axis 1: 3 -> 4",) * config.recapture_limit
    table = _table(_capture(first, [(2, 3)]), recaptures=config.recapture_limit, spent=spent)
    decision = decide(table, _call(torch.ones(5, 3)), Options(), None)
    assert isinstance(decision, GiveUp) and "last: shape drift" in decision.why
    assert decision.why.endswith(f"spent by {config.recapture_limit} shape drift")


def test_re_captures_that_spent_nothing_leave_the_budget_whole():
    first = _call(torch.ones(2, 3))
    table = _table(_capture(first, [(2, 3)]), recaptures=config.recapture_limit)  # new keys, reloads
    assert isinstance(decide(table, _call(torch.ones(5, 3)), Options(), None), CapturePlan)


def test_a_call_that_differentiates_stays_eager():
    x = torch.ones(2, requires_grad=True)
    with torch.enable_grad():
        assert isinstance(decide(CacheTable(), _call(x), Options(), None), Eager)


def test_equal_sized_axes_of_two_inputs_are_tied_unless_seen_apart():
    call = _call(torch.ones(2, 8), "a", torch.ones(2, 8), options=Options(dynamic=True))
    plan = decide(CacheTable(), call, Options(dynamic=True), None)
    assert plan.ties == (((0, 0), (1, 0)), ((0, 1), (1, 1)))
    apart = Knowledge(untied=frozenset({frozenset({("x", 1), ("y", 1)})}))
    plan = decide(CacheTable(knowledge=apart), call, Options(dynamic=True), None)
    assert plan.ties == (((0, 0), (1, 0)),)


def test_a_changed_int_becomes_a_graph_input():
    first = _call(torch.ones(2), 3)
    table = _table(_capture(first, [(2,)]))
    plan = decide(table, _call(torch.ones(2), 4), Options(), None)
    assert isinstance(plan, CapturePlan) and plan.call.lifted == frozenset({1})
    assert plan.reason == "static value changed: 'mode' 3 -> 4; it becomes a graph input"


def test_a_reason_names_the_first_few_mismatches_and_counts_the_rest():
    first = _call(torch.ones(4, 3))
    long = ("gt", ("max", *[("size", 0, 0)] * 60), ("const", 8))  # a Swin window's sympy runs to KBs
    conditions = tuple(((("gt", ("size", 0, 0), ("const", 4 + k)), False)) for k in range(4)) + ((long, False),)
    capture = _capture(first, [("x_dim0", 3)], conditions=conditions, dynamic=({0: None},))
    plan = decide(_table(capture), _call(torch.ones(9, 3)), Options(), None)
    assert plan.reason.endswith("; and 2 more") and plan.reason.count("was False, now True") == 3, plan.reason
    lengthy = decide(_table(_capture(first, [("x_dim0", 3)], conditions=((long, False),), dynamic=({0: None},))),
                     _call(torch.ones(9, 3)), Options(), None)
    assert len(lengthy.reason) == 240 and lengthy.reason.endswith("..."), lengthy.reason
