"""A fixed corpus of pytrees round-tripped through capture, as inputs and as outputs."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as torch_pytree
from transformers.modeling_outputs import BaseModelOutput

import clika_runtime as cr
from clika_runtime import trees
from conftest import Counted


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
