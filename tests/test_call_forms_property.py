"""Property: a compiled function returns what the eager call returns, or raises what it raises,
for arguments built from every kind of leaf a user passes (tensors of several dtypes and ranks,
torch.Size, numbers with NaN and -0.0, strings, dtypes, devices, enums, slices, Ellipsis,
namedtuples, dataclasses, dicts with int and str keys), nested, in positional and keyword slots,
called three times so later calls are served by the graph."""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import warnings

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import clika_runtime as cr


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Level(enum.IntEnum):
    ONE = 1
    TWO = 2


Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Box:
    a: object
    b: object = None


# ------------------------------------------------------------------------------------------ target

def _walk(value, tensors: list):
    """The tree with each tensor leaf replaced by a computation on it, statics kept (as text where a
    graph cannot return them); the tensors seen, in order, go to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return value.float().sum() * 1.5 + value.ndim, (value * 2) if value.dtype != torch.bool else ~value
    if isinstance(value, torch.Size):
        return [int(s) for s in value], value.numel()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_walk(v, tensors) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _walk(v, tensors) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: _walk(getattr(value, f.name), tensors) for f in dataclasses.fields(value)}
    if value is None or type(value) in (bool, int, float, str):
        return value
    return repr(value)  # dtype, device, enum, slice, Ellipsis: returned as what the target saw


def _target(*args, **kwargs):
    if "raise" in kwargs.values() or "raise" in args:
        raise ValueError("the target raises for 'raise'")
    tensors: list = []
    out = _walk((args, kwargs), tensors)
    total = sum((t.float().sum() for t in tensors), torch.tensor(0.0))
    numbers = [v for v in _statics((args, kwargs)) if type(v) in (int, float, bool)]
    return {"tree": out, "total": total + sum(float(n) for n in numbers if math.isfinite(n)) if numbers else total,
            "types": [type(v).__name__ for v in _statics((args, kwargs))]}


def _statics(tree):
    if isinstance(tree, torch.Tensor):
        return []
    if isinstance(tree, dict):
        return list(tree) + [s for v in tree.values() for s in _statics(v)]
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        return [s for v in tree for s in _statics(v)]
    if dataclasses.is_dataclass(tree):
        return [s for f in dataclasses.fields(tree) for s in _statics(getattr(tree, f.name))]
    return [tree]


def _named(a, b=None, *rest, c=0, **kw):
    return _target(a, b, *rest, c=c, **kw)


_VARIADIC = cr.compile(_target)
_NAMED = cr.compile(_named)

# --------------------------------------------------------------------------------------- strategies

_DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    values = torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return values.to(dtype)


statics = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3),
    st.sampled_from([0.5, -0.0, 0.0, float("nan"), float("inf"), 1.0]),
    st.sampled_from(["relu", "", "é"]),
    st.sampled_from([torch.float32, torch.int64, torch.device("cpu")]),
    st.sampled_from([Mode.FAST, Mode.SLOW, Level.ONE, Level.TWO]),
    st.sampled_from([slice(1, None), slice(None, 2, -1), Ellipsis]),
    st.builds(torch.Size, st.lists(st.integers(0, 4), max_size=3)),
    st.tuples(st.integers(0, 3), st.integers(0, 3)), st.lists(st.integers(0, 3), max_size=3),
)
leaves = st.one_of(tensors(), statics)
keys = st.one_of(st.integers(0, 2), st.sampled_from(["a", "b", "mask"]), st.sampled_from([True, 1.0]))
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(keys, inner, max_size=3),
        st.builds(Pair, inner, inner), st.builds(Box, inner, inner),
    ),
    max_leaves=6,
)
kw_names = st.sampled_from(["c", "d", "mask", "scale"])


# --------------------------------------------------------------------------------------- comparison

def assert_same(got, want, path="out"):
    assert type(got) is type(want), f"{path}: {type(got).__name__}, eager {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{path}: {m}")
    elif isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(1, want)), \
            f"{path}: {got!r}, eager {want!r}"
    elif isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], f"{path}: keys {list(got)}, eager {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)}, eager {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r}, eager {want!r}"


def check_calls(f, target, args, kwargs, times=3):
    """Call ``f`` ``times`` times; each returns what ``target`` returns or raises what it raises."""
    try:
        want, error = target(*args, **kwargs), None
    except Exception as raised:  # noqa: BLE001
        want, error = None, raised
    for _ in range(times):
        if error is not None:
            try:
                f(*args, **kwargs)
            except type(error) as raised:
                assert str(raised) == str(error)
            else:
                raise AssertionError(f"eager raised {error!r}, the compiled call returned")
        else:
            assert_same(f(*args, **kwargs), want)


def _twin(value):
    """The tree with statics swapped for values equal to them under ``==`` but of another type
    (``1`` -> ``True``, ``True`` -> ``1``, ``0.0`` -> ``-0.0``, an IntEnum -> its int, dict key ``1`` ->
    ``1.0``): a capture keyed by ``==`` alone would serve the twin the original's answer."""
    if isinstance(value, torch.Tensor) or isinstance(value, torch.Size):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if type(value) is bool:
        return int(value)
    if type(value) is float and value == 0:
        return -value
    if isinstance(value, Level):
        return int(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_twin(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_twin(v) for v in value)
    if isinstance(value, dict):
        return {(float(k) if type(k) in (int, bool) else k): _twin(v) for k, v in value.items()}
    if isinstance(value, Box):
        return Box(_twin(value.a), _twin(value.b))
    return value


def _hits(*fns):
    return sum(c.hits for f in fns for c in f.captures)


def test_calls_return_what_eager_returns():
    cr.config.cache_size = 64  # examples are many keys; the fixture restores the config
    cr.config.recapture_limit = 1000
    served = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(args=st.lists(trees, min_size=1, max_size=3), kwargs=st.dictionaries(kw_names, trees, max_size=2),
           named=st.booleans(), raises=st.booleans())
    @example(args=[{1: torch.ones(2)}], kwargs={}, named=False, raises=False)  # dict keys 1 / 1.0
    @example(args=[torch.ones(2), Box(1, 0.0)], kwargs={"c": [1]}, named=True, raises=False)  # 1 / True in a Box
    def one(args, kwargs, named, raises):
        if raises and kwargs:
            kwargs[next(iter(kwargs))] = "raise"
        f, target = (_NAMED, _named) if named else (_VARIADIC, _target)
        if named and len(args) < 1:
            return
        before = _hits(_VARIADIC, _NAMED)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_calls(f, target, tuple(args), kwargs)
            twin_args, twin_kwargs = _twin(tuple(args)), _twin(kwargs)
            check_calls(f, target, twin_args, twin_kwargs, times=2)
        served.append(_hits(_VARIADIC, _NAMED) - before)

    one()
    assert sum(served) >= 5, f"graphs served {sum(served)} calls of {3 * len(served)}"
    assert _VARIADIC.state is not cr.CompiledFunction.State.Fallback, _VARIADIC.fallback_reason
