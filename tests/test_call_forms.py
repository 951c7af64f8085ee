"""Calls whose static values compare equal across types (1, True, 1.0, IntEnum) must not share a
capture: the target may read the type, and a served call would answer for the other one."""

from __future__ import annotations

import dataclasses
import enum

import torch

import clika_runtime as cr


class Level(enum.IntEnum):
    ONE = 1


@dataclasses.dataclass(frozen=True)
class Config:
    k: object


def _bool_scales(x, cfg):
    return x + 10 * cfg.k if isinstance(cfg.k, bool) else x * cfg.k


def test_a_dataclass_field_true_is_not_one():
    f = cr.compile(_bool_scales)
    x = torch.ones(2)
    with torch.no_grad():
        for k in (1, True, 1, True, Level.ONE, 1.0, True):
            torch.testing.assert_close(f(x, Config(k)), _bool_scales(x, Config(k)))
    assert sum(c.hits for c in f.captures) >= 2


def _types_of(x, cfg):
    return x * 2, [type(v).__name__ for v in cfg.k]


def test_items_of_a_static_container_key_by_type():
    f = cr.compile(_types_of)
    x = torch.ones(2)
    with torch.no_grad():
        for k in ((1,), (True,), frozenset({1}), frozenset({True}), {1: 0}, {True: 0}, {1.0: 0}, (1,)):
            out = f(x, Config(k))
            assert out[1] == _types_of(x, Config(k))[1], k
    assert sum(c.hits for c in f.captures) >= 1


def _first_key(d):
    return d[next(iter(d))] * 2, [type(k).__name__ for k in d]


def test_dict_keys_one_true_and_one_point_oh_are_three_structures():
    f = cr.compile(_first_key)
    x = torch.ones(2)
    with torch.no_grad():
        for key in (1, True, 1.0, 1, True, 0.0, -0.0, 0.0):
            got, types = f({key: x})
            assert types == [type(key).__name__], key
            torch.testing.assert_close(got, x * 2)
    assert sum(c.hits for c in f.captures) >= 2


def test_keys_of_another_type_miss_with_a_reason():
    f = cr.compile(_first_key)
    x = torch.ones(2)
    with torch.no_grad():
        f({1: x})
        f({True: x})
    assert f.recapture_count == 1 and "dict keys" in f.recapture_reasons[0], f.recapture_reasons


def _either_way(a, b):
    return a * b + 1 if isinstance(a, torch.Tensor) else b * a - 1


def test_trap_a_tensor_and_a_number_that_swap_places_are_another_key():
    """``f(x, 0.5)`` then ``f(0.5, x)``: the same structure, the same static values and the same
    tensor metadata, only in other places; the key did not say which leaf was the tensor, and the
    second call was served the first call's graph (1.5 where eager gives -0.5; with nested
    statics, an output tree of the other shape). Found by the call-forms property test."""
    f = cr.compile(_either_way)
    x = torch.ones(2)
    with torch.no_grad():
        for args in ((x, 0.5), (x, 0.5), (0.5, x), (0.5, x), (x, 0.5)):
            torch.testing.assert_close(f(*args), _either_way(*args))
    assert sum(c.hits for c in f.captures) == 3 and len(f.captures) == 2
