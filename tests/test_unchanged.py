"""The served call's checks of baked tensors and watched state: the C forms (``_unchanged.c``)
answer exactly as the Python forms (``state/unchanged.py``) on every kind of change, and the C
forms are the ones running wherever a C compiler was there to build them."""

from __future__ import annotations

import operator
import shutil
import sysconfig

import numpy as np
import pytest
import torch

from clika_runtime.state import unchanged

needs_c = pytest.mark.skipif(not unchanged.COMPILED, reason="the C checks were not built (no C compiler at install)")
_data_ptr = torch.Tensor.data_ptr


def test_the_c_checks_are_built_where_a_compiler_is():
    """An install with a compiler builds them: a failed build would fall back to Python silently
    and only the benchmarks would show it."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    assert unchanged.COMPILED or shutil.which(compiler) is None


def _weights_args(model: torch.nn.Linear, closed: torch.Tensor) -> tuple:
    slots = model._parameters
    return (_data_ptr, (model.weight, model.bias, closed), model.weight._version + model.bias._version + closed._version,
            (slots, slots), ("weight", "bias"), (model.weight.data_ptr(), model.bias.data_ptr()),
            (closed,), (closed.data_ptr(),))


def _changes() -> list:
    """Each: what to do to (model, closed) after the arguments were taken, and whether the
    check must still say unchanged."""
    def bumped(m, c):
        with torch.no_grad():
            m.weight.add_(1)

    def data_swapped(m, c):
        m.bias.data = torch.zeros(3)  # keeps the version, moves the address

    def closed_written(m, c):
        c.mul_(2)

    def entry_gone(m, c):
        del m._parameters["bias"]

    def entry_none(m, c):
        m._parameters["bias"] = None

    def untouched(m, c):
        m.weight.sum()

    return [(untouched, True), (bumped, False), (data_swapped, False), (closed_written, False),
            (entry_gone, False), (entry_none, False)]


@needs_c
@pytest.mark.parametrize("change, same", _changes(), ids=lambda x: getattr(x, "__name__", str(x)))
def test_weights_checks_agree(change, same):
    model, closed = torch.nn.Linear(3, 3), torch.ones(2)
    args = _weights_args(model, closed)
    change(model, closed)
    assert unchanged.weights_unchanged(*args) is same
    assert unchanged._weights_unchanged(*args) is same


class _Loud:
    def __eq__(self, other):
        raise KeyboardInterrupt


def _state_cases() -> list:
    """(sized, sizes, readers, containers, values) and the answer."""
    config = {"scale": 2, "names": ["a", "b"], "array": np.arange(3)}
    two = operator.itemgetter("scale", "names")
    return [
        ((config,), (3,), (two,), (config,), ((2, ["a", "b"]),), True),
        ((config,), (3,), (operator.itemgetter("scale"),), (config,), (2.0,), True),  # equal, not identical
        ((config,), (4,), (two,), (config,), ((2, ["a", "b"]),), False),  # an entry added
        ((config,), (3,), (two,), (config,), ((2, ["a"]),), False),  # a list changed in place
        ((), (), (operator.itemgetter("array"),), (config,), (np.arange(3),), False),  # == cannot answer
        ((), (), (operator.itemgetter("gone"),), (config,), (1,), False),  # an entry deleted
        ((), (), (), (), (), True),
    ]


@needs_c
@pytest.mark.parametrize("case", _state_cases())
def test_state_checks_agree(case):
    *args, same = case
    assert unchanged.state_unchanged(*args) is same
    assert unchanged._state_unchanged(*args) is same


@needs_c
@pytest.mark.parametrize("check", ["state_unchanged", "_state_unchanged"])
def test_an_interrupt_inside_a_check_reaches_the_caller(check):
    """A Ctrl-C while a watched value compares is the user's, not an unreadable value."""
    with pytest.raises(KeyboardInterrupt):
        getattr(unchanged, check)((), (), (operator.itemgetter("x"),), ({"x": _Loud()},), (1,))


@needs_c
def test_the_c_checks_refuse_arguments_of_the_wrong_shape():
    with pytest.raises(TypeError):
        unchanged.state_unchanged([], (), (), (), ())
    with pytest.raises(ValueError):
        unchanged.state_unchanged((), (), (len,), (), ())
    with pytest.raises(TypeError):
        unchanged.weights_unchanged(_data_ptr, (), 0)
    with pytest.raises(TypeError, match="argument 2 must be a tuple"):  # it returned NULL with no exception set
        unchanged.weights_unchanged(_data_ptr, [], 0, (), (), (), (), ())
