"""Non-tensor leaves are static: keyed by type and value, NaN-safe, unhashable ones served eagerly."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

import pytest
import torch
from conftest import Counted

import clika_runtime as cr
from clika_runtime import CaptureError


def _scaled(x, k):
    return x * k if not isinstance(k, bool) else x + 10 * k


def test_one_one_point_oh_and_true_are_three_keys():
    target = Counted(_scaled)
    f = cr.compile(target, specialize=True)
    x = torch.ones(2)
    for k in (1, 1.0, True):
        torch.testing.assert_close(f(x, k), _scaled(x, k))
    assert f.recapture_count == 2
    calls = target.calls
    for k in (True, 1, 1.0):
        torch.testing.assert_close(f(x, k), _scaled(x, k))
    assert target.calls == calls


def test_nan_static_leaf_hits_the_cache():
    target = Counted(lambda x, fill: torch.nan_to_num(x, nan=0.0) + (0.0 if math.isnan(fill) else fill))
    f = cr.compile(target)
    x = torch.tensor([1.0, float("nan")])
    f(x, float("nan"))
    calls = target.calls
    for _ in range(3):
        torch.testing.assert_close(f(x, float("nan")), torch.tensor([1.0, 0.0]))
    assert target.calls == calls and f.recapture_count == 0


def test_none_and_strings_are_static():
    f = cr.compile(lambda x, bias, act: (x if bias is None else x + bias).relu() if act == "relu" else x)
    x = torch.randn(4)
    torch.testing.assert_close(f(x, None, "relu"), x.relu())
    torch.testing.assert_close(f(x, None, "id"), x)
    assert f.recapture_count == 1


def test_unhashable_static_leaf_serves_eagerly_with_one_warning():
    class Opaque:
        __hash__ = None

        def __init__(self, k):
            self.k = k

    f = cr.compile(lambda x, cfg: x * cfg.k)
    x = torch.ones(2)
    with pytest.warns(UserWarning, match="unhashable type Opaque") as record:
        torch.testing.assert_close(f(x, Opaque(2)), x * 2)
        torch.testing.assert_close(f(x, Opaque(3)), x * 3)
    assert len(record) == 1
    assert f.state is cr.CompiledFunction.State.Fallback and "unhashable type Opaque" in f.fallback_reason
    with pytest.raises(CaptureError, match="unhashable type Opaque"):
        cr.compile(lambda x, cfg: x * cfg.k, fullgraph=True)(x, Opaque(2))


def test_negative_zero_is_not_zero():
    f = cr.compile(lambda x, s: x / s)
    x = torch.ones(2)
    torch.testing.assert_close(f(x, 0.0), torch.full((2,), float("inf")))
    torch.testing.assert_close(f(x, -0.0), torch.full((2,), float("-inf")))


def test_a_torch_size_argument_drives_shapes_and_is_served():
    # A shape passed along (reshape(target.shape)) rebuilt a torch.Size from placeholders and raised.
    f = cr.compile(lambda x, s: x.reshape(s) * 2)
    x = torch.randn(6)
    with torch.no_grad():
        for size in ([2, 3], [3, 2], [3, 2], [2, 3]):
            torch.testing.assert_close(f(x, torch.Size(size)), x.reshape(size) * 2)
    assert f.state is cr.CompiledFunction.State.Compiled and sum(c.hits for c in f.captures) >= 2


def test_a_slice_of_a_shape_as_a_size_argument_is_served():
    f = cr.compile(lambda x, size: torch.nn.functional.interpolate(x, size=size))
    target = torch.randn(1, 1, 8, 8)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(1, 1, 4, 4)
            got = f(x, target.shape[-2:])
            torch.testing.assert_close(got, torch.nn.functional.interpolate(x, size=(8, 8)))
    assert f.captures[0].hits == 1


def test_a_returned_torch_size_comes_back_as_a_torch_size():
    f = cr.compile(lambda x, s: (x.reshape(s), s))
    with torch.no_grad():
        for _ in range(2):
            out, size = f(torch.randn(6), torch.Size([2, 3]))
    assert type(size) is torch.Size and size == torch.Size([2, 3]) and out.shape == (2, 3)


class _Scale(float):
    pass


class _Mode(str):
    pass


class _Slotted:
    __slots__ = ("k", "__hidden")  # a private slot is stored under its mangled name

    def __init__(self, k: float) -> None:
        self.k = "the same for every value"
        self.__hidden = k


def _times(x, k):
    return x * k


@dataclasses.dataclass
class _Derived:
    name: str
    k_in: dataclasses.InitVar[float] = 1.0

    def __post_init__(self, k_in: float) -> None:
        self.k = k_in  # not a field: set from an InitVar


@pytest.mark.parametrize("make", [
    _Scale,
    lambda k: _Mode("a" * int(k)),
    lambda k: functools.partial(_times, k=k),
    lambda k: functools.partial(_times, k),
    _Slotted,
    lambda k: _Derived("same", k),
], ids=["float subclass", "str subclass", "partial keyword", "partial positional", "slots", "dataclass initvar"])
def test_trap_statics_whose_value_is_not_in_their_dict_key_by_their_value(make):
    # A float or str subclass, a partial and a slotted object were keyed by their (empty) __dict__:
    # f(x, Scale(5.0)) was served Scale(1.0)'s graph, 1.0 where eager gives 5.0 (found by a trial).
    def fn(x, s):
        if isinstance(s, functools.partial):
            return s(x)
        if isinstance(s, _Slotted):
            return x * s._Slotted__hidden
        if isinstance(s, _Derived):
            return x * s.k
        return x * (len(s) if isinstance(s, str) else s)

    f = cr.compile(fn)
    x = torch.ones(3)
    with torch.no_grad():
        for k in (1.0, 5.0, 5.0, 2.0):
            torch.testing.assert_close(f(x, make(k)), fn(x, make(k)))


@dataclasses.dataclass
class _Table:
    size: int = 4

    @functools.cached_property
    def entries(self) -> list:  # made from the fields, filled by the first call
        return list(range(1000))

    def __post_init__(self) -> None:
        self.lock = threading.Lock()  # set up beside the fields: not part of the value


def test_a_dataclass_static_is_keyed_past_its_cached_properties_and_locks():
    # Reading a dataclass's attributes beyond its fields (an InitVar's value) read a filled
    # cached_property too: a large one left every later call unkeyable, eager (an attack).
    def fn(x, table):
        return x * len(table.entries) * table.size

    f = cr.compile(fn)
    table, x = _Table(), torch.ones(3)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(f(x, table), fn(x, table))
    assert len(f.captures) == 1 and f.captures[0].hits == 3
