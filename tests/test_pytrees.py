"""A fixed corpus of pytrees round-tripped through capture, as inputs and as outputs."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.utils._pytree as torch_pytree
from conftest import Counted
from transformers import BatchEncoding
from transformers.modeling_outputs import BaseModelOutput

import clika_runtime as cr
from clika_runtime.trees import pytrees as trees


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    weights: torch.Tensor


torch_pytree.register_dataclass(Batch)


def t(*shape):
    return torch.randn(*shape)


CORPUS = {
    "tensor": lambda: t(2),
    "tuple": lambda: (t(2), t(3)),
    "list": lambda: [t(2), [t(1), t(2)]],
    "dict_insertion_order": lambda: {"zeta": t(2), "alpha": t(3)},
    "nested_dicts": lambda: {"outer": {"b": t(2), "a": (t(1), t(1))}, "z": t(2)},
    "namedtuple": lambda: Pair(t(2), t(2)),
    "ordereddict": lambda: collections.OrderedDict(second=t(2), first=t(2)),
    "deque": lambda: collections.deque([t(2), t(2)]),
    "dataclass": lambda: Batch(t(3), t(3)),
    "model_output": lambda: BaseModelOutput(last_hidden_state=t(1, 2, 4), hidden_states=(t(1, 2, 4),)),
    "with_none": lambda: (t(2), None, {"k": None, "v": t(2)}),
}


def _double(tree):
    return torch_pytree.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, tree)


def _assert_same_tree(got, expected):
    assert type(got) is type(expected)
    got_leaves, got_spec = trees.flatten(got)
    exp_leaves, exp_spec = trees.flatten(expected)
    assert got_spec == exp_spec
    if isinstance(expected, dict):
        assert list(got.keys()) == list(expected.keys())
    for g, e in zip(got_leaves, exp_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e)
        else:
            assert g == e


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_tree_round_trips_as_input_and_output(name):
    target = Counted(_double)
    f = cr.compile(target)
    f(CORPUS[name]())
    assert f.state is cr.CompiledFunction.State.Compiled, f.recapture_reasons
    calls = target.calls
    tree = CORPUS[name]()
    _assert_same_tree(f(tree), _double(tree))
    assert target.calls == calls  # served by the graph


def test_non_tensor_output_leaves_are_returned():
    f = cr.compile(lambda x: {"y": x + 1, "tag": "v1", "none": None, "n": 3})
    f(torch.zeros(2))
    out = f(torch.ones(2))
    assert out["tag"] == "v1" and out["none"] is None and out["n"] == 3
    torch.testing.assert_close(out["y"], torch.full((2,), 2.0))
    assert list(out) == ["y", "tag", "none", "n"]



def test_a_size_returned_from_a_dynamic_graph_is_a_torch_size():
    f = cr.compile(lambda x: (x.sum(0), x.size()))
    for rows in (3, 5, 7):  # 5 drifts: axis 0 dynamic, its size a graph output
        out = f(t(rows, 4))
    assert f.state is cr.CompiledFunction.State.Compiled and f.recapture_count == 1
    assert type(out[1]) is torch.Size and out[1] == (7, 4) and out[1].numel() == 28


# ------------------------------------------------- containers of tensors torch's registry does not know


@dataclasses.dataclass
class Unregistered:
    ids: torch.Tensor
    scale: float = 2.0


class Features(collections.UserDict):
    """A ``UserDict``, as the tokenizer's ``BatchEncoding`` is."""


class Prefixed(collections.UserDict):
    """A ``UserDict`` whose constructor takes something else than its items."""

    def __init__(self, prefix, **items):
        super().__init__({prefix + key: value for key, value in items.items()})


class Named(collections.UserDict):
    """A ``UserDict`` with state beside its items."""

    def __init__(self, name, **items):
        super().__init__(**items)
        self.name = name


@dataclasses.dataclass(slots=True, frozen=True)
class SlottedBatch:
    ids: torch.Tensor


def _ids(batch):
    batch = batch.batch if isinstance(batch, Wrapper) else batch
    if isinstance(batch, (Unregistered, SlottedBatch)):
        return batch.ids * getattr(batch, "scale", 2.0)
    return batch["ids"] * 2


@dataclasses.dataclass
class Wrapper:
    batch: Unregistered


@pytest.mark.parametrize("make", [lambda ids: Unregistered(ids), lambda ids: Features(ids=ids),
                                  lambda ids: BatchEncoding({"ids": ids}), lambda ids: Wrapper(Unregistered(ids)),
                                  lambda ids: Prefixed("", ids=ids), lambda ids: SlottedBatch(ids)],
                         ids=["dataclass", "UserDict", "BatchEncoding", "nested", "own constructor", "slots"])
def test_unregistered_containers_of_tensors_feed_the_graph(make):
    # They were one static leaf that cannot key a capture: every call eager, for good.
    target = Counted(_ids)
    f = cr.compile(target)
    f(make(t(3)))
    name = "batch_batch_ids" if isinstance(make(t(1)), Wrapper) else "batch_ids"
    assert f.state is cr.CompiledFunction.State.Compiled and f.input_names == [name]
    calls, ids = target.calls, t(3)
    torch.testing.assert_close(f(make(ids)), ids * 2)
    assert target.calls == calls


def test_a_user_dict_with_state_beside_its_items_runs_eagerly_and_says_why():
    # Rebuilt from its items alone, the trace would read another name than the call passed.
    target = Counted(lambda batch: batch["ids"] * 2 if batch.name == "double" else batch["ids"])
    f = cr.compile(target)
    with pytest.warns(UserWarning, match="unhashable type Named"):
        torch.testing.assert_close(f(Named("double", ids=torch.ones(2))), torch.full((2,), 2.0))
    torch.testing.assert_close(f(Named("same", ids=torch.ones(2))), torch.ones(2))
    assert f.state is cr.CompiledFunction.State.Fallback and target.calls == 2  # nothing will serve such calls
    assert "unhashable type Named" in f.fallback_reason


def test_an_unregistered_dataclass_of_tensors_is_returned_rebuilt():
    f = cr.compile(lambda x: Unregistered(x + 1, scale=3.0))
    f(t(2))
    out = f(torch.zeros(2))
    assert f.state is cr.CompiledFunction.State.Compiled
    assert type(out) is Unregistered and out.scale == 3.0
    torch.testing.assert_close(out.ids, torch.ones(2))


@dataclasses.dataclass
class Scaled:
    """State outside the constructor's fields: a field set after construction, one made in
    ``__post_init__`` from an ``InitVar``, a tensor derived there."""

    x: torch.Tensor
    factor: dataclasses.InitVar[float] = 1.0
    scale: float = dataclasses.field(init=False, default=1.0)

    def __post_init__(self, factor):
        self.k = factor
        self.doubled = self.x * 2


def _scaled(b):
    return (b.x + b.doubled) * b.scale * b.k


def test_a_dataclass_is_taken_as_it_is_not_as_its_constructor_would_build_it():
    # Rebuilt through its constructor, the trace saw the defaults (and placeholders crashed
    # __post_init__): a later scale or factor was served with the graph of the first.
    f = cr.compile(_scaled)
    for scale, factor in ((1.0, 1.0), (1.0, 1.0), (3.0, 1.0), (3.0, 2.0)):
        b = Scaled(t(2, 3), factor)
        b.scale = scale
        torch.testing.assert_close(f(b), _scaled(b))
    assert f.state is cr.CompiledFunction.State.Compiled and f.recapture_count == 2


@dataclasses.dataclass
class Shifted:
    y: torch.Tensor

    def __post_init__(self):
        self.y = self.y + 1
        self.z = self.y * 0


def _shifted(x):
    out = Shifted(x)
    out.z = out.z + 5
    return out


def test_a_returned_dataclass_is_rebuilt_as_it_was_returned():
    # Rebuilt through its constructor, __post_init__ ran again on served outputs.
    f = cr.compile(_shifted)
    f(t(2))
    x = t(2)
    got, want = f(x), _shifted(x)
    assert f.state is cr.CompiledFunction.State.Compiled
    torch.testing.assert_close(got.y, want.y)
    torch.testing.assert_close(got.z, want.z)


@dataclasses.dataclass
class Settings:
    scale: float = 2.0


@pytest.mark.parametrize("value, other", [(Settings(), Settings(3.0)), (np.float32(0.5), np.float32(0.25)),
                                          (np.int64(3), np.int64(4))], ids=["mutable dataclass", "np.float32", "np.int64"])
def test_static_configs_and_numpy_scalars_key_by_value(value, other):
    target = Counted(lambda x, s: x * (s.scale if isinstance(s, Settings) else s))
    f = cr.compile(target)
    x = t(3)
    f(x, value)
    calls = target.calls
    torch.testing.assert_close(f(x, value), target.fn(x, value))
    assert target.calls == calls and f.state is cr.CompiledFunction.State.Compiled
    torch.testing.assert_close(f(x, other), target.fn(x, other))
    assert f.recapture_count == 1


# ----------------------------------------------------------------- output rebuild without the constructor

BUILT = collections.Counter()  # constructor runs, by class name


@dataclasses.dataclass
class Plain:
    x: torch.Tensor
    y: torch.Tensor | None = None

    def __post_init__(self):
        BUILT["Plain"] += 1


@dataclasses.dataclass
class WithTotal:  # the constructor computes state from a leaf: it must run on every rebuild
    x: torch.Tensor
    total: torch.Tensor | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        BUILT["WithTotal"] += 1
        self.total = self.x.sum()


@dataclasses.dataclass(slots=True)
class Slotted:  # state outside __dict__
    x: torch.Tensor

    def __post_init__(self):
        BUILT["Slotted"] += 1


torch_pytree.register_pytree_node(Plain, lambda o: ([o.x, o.y], None), lambda c, _: Plain(*c))
torch_pytree.register_pytree_node(WithTotal, lambda o: ([o.x], None), lambda c, _: WithTotal(*c))
torch_pytree.register_pytree_node(Slotted, lambda o: ([o.x], None), lambda c, _: Slotted(*c))


def _state(obj):
    attrs = {k: getattr(obj, k) for k in getattr(obj, "__slots__", ())} or dict(vars(obj))
    return type(obj), attrs, list(dict.items(obj)) if isinstance(obj, dict) else None


def _assert_same_state(got, expected):
    got_type, got_attrs, got_items = _state(got)
    exp_type, exp_attrs, exp_items = _state(expected)
    assert got_type is exp_type and list(got_attrs) == list(exp_attrs)
    for k, v in exp_attrs.items():
        if v is None:
            assert got_attrs[k] is None
        elif dataclasses.is_dataclass(v):  # a node inside the node
            _assert_same_state(got_attrs[k], v)
        else:
            torch.testing.assert_close(got_attrs[k], v)  # tensors, and tuples of them
    if exp_items is not None:
        assert [k for k, _ in got_items] == [k for k, _ in exp_items]
        for (_, g), (_, e) in zip(got_items, exp_items):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    "make, fast",
    [
        (lambda: BaseModelOutput(last_hidden_state=t(1, 2, 4)), True),
        (lambda: Plain(t(2), t(3)), True),
        (lambda: Batch(t(3), t(3)), True),
        (lambda: WithTotal(t(3)), False),
        (lambda: Slotted(t(2)), False),
        (lambda: Plain(t(2), None), False),  # a None leaf: identity says nothing about where it went
        (lambda: BaseModelOutput(last_hidden_state=t(1, 2, 4), hidden_states=(t(1, 2, 4),)), True),  # nested
        (lambda: Plain(WithTotal(t(3)), t(2)), True),  # cloned over a child whose constructor must run
    ],
    ids=["model_output", "plain_dataclass", "registered_dataclass", "computed_attribute", "slots", "none_leaf",
         "nested", "nested_computed_child"],
)
def test_output_trees_are_rebuilt_as_their_constructor_builds_them(make, fast):
    trees.sync_registry()
    leaves, spec = trees.flatten(make())
    rebuild = trees.rebuilder(spec, leaves)
    assert (rebuild != spec.unflatten) == fast
    # New values: state the constructor computes from them must follow (WithTotal.total).
    fresh = [leaf * 3 if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    _assert_same_state(rebuild(fresh), spec.unflatten(fresh))


def test_the_fast_rebuild_skips_the_constructor_and_returns_fresh_objects():
    trees.sync_registry()
    leaves, spec = trees.flatten(Plain(t(2), t(3)))
    rebuild = trees.rebuilder(spec, leaves)
    before = BUILT["Plain"]
    a, b = rebuild([t(2), t(3)]), rebuild([t(2), t(3)])
    assert BUILT["Plain"] == before
    assert a is not b and a.x is not b.x


def test_one_tensor_twice_keeps_the_constructor():
    trees.sync_registry()
    x = t(2)
    leaves, spec = trees.flatten(Plain(x, x))
    assert trees.rebuilder(spec, leaves) == spec.unflatten
