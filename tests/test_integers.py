"""Integer arithmetic comes out exact, as in torch: torchlib divided integers with a rounding mode
in float32 (wrong past 2**24; a zero divisor gave INT64_MIN where torch raises), and a graph
verified on small values served the wrong quotients for large ones."""

from __future__ import annotations

import pytest
import torch

import clika_runtime as cr


def _divided(mode):
    return lambda a, b: torch.div(a, b, rounding_mode=mode)


@pytest.mark.parametrize("mode", ["floor", "trunc"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_an_integer_division_with_a_rounding_mode_is_exact(mode, dtype):
    f = cr.compile(_divided(mode))
    small = torch.tensor([10, -7, 4999, -5000], dtype=dtype)
    f(small, torch.tensor([3, 2, -7, 3], dtype=dtype))  # captured and verified on small values
    a = torch.tensor([16777217, -24_999_999, 2_000_000_001, -7], dtype=dtype)
    b = torch.tensor([1, 5000, -3, 2], dtype=dtype)
    got = f(a, b)
    assert f.state is cr.CompiledFunction.State.Compiled and f.captures[0].hits == 1  # served by the graph
    assert got.dtype == dtype and torch.equal(got, _divided(mode)(a, b))


@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_an_integer_division_by_a_python_number_is_exact(mode):
    f = cr.compile(lambda a: torch.div(a, 5000, rounding_mode=mode))
    f(torch.tensor([10, -7]))
    a = torch.tensor([24_999_999, -16777217])
    assert torch.equal(f(a), torch.div(a, 5000, rounding_mode=mode))


@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_an_integer_division_by_zero_raises_as_in_torch(mode):
    f = cr.compile(_divided(mode))
    f(torch.tensor([10, 20]), torch.tensor([2, 5]))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        f(torch.tensor([10, 20]), torch.tensor([2, 0]))


_TABLE = torch.arange(40.0).reshape(10, 4)


def _index_put(x, ids):
    out = x.clone()
    out[ids] = 1.0
    return out


@pytest.mark.parametrize("lookup", [lambda ids: _TABLE[ids] * 2, lambda ids: _TABLE[ids, ids % 4],
                                    lambda ids: _index_put(_TABLE, ids)],
                         ids=["rows", "pairs", "index_put"])
def test_trap_int32_indices_are_served(lookup):
    # torchlib gave GatherND the int32 indices as they came (ONNX takes int64 only): onnxruntime
    # refused the graph and the key served eagerly, saying "invalid model".
    f = cr.compile(lookup)
    ids = torch.tensor([[1, 2], [3, 9]], dtype=torch.int32)
    f(ids)
    assert f.state is cr.CompiledFunction.State.Compiled, f.fallback_reason
    other = torch.tensor([[0, 5], [7, 8]], dtype=torch.int32)
    torch.testing.assert_close(f(other), lookup(other))
    assert f.captures[0].hits == 1


_POWERS = {
    "a ** b": lambda a, b: a ** b,
    "a ** 20": lambda a, b: a ** 20,
    "7 ** b": lambda a, b: 7 ** b,
    "a ** 2 + b ** 3": lambda a, b: a ** 2 + b ** 3,
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
@pytest.mark.parametrize("name", _POWERS)
def test_trap_an_integer_power_is_exact_and_wraps_as_in_torch(name, dtype):
    """onnxruntime's integer Pow goes through a double: past 2**53 the last digits were wrong
    (7 ** 20 served ...612000 for ...612001) and an overflow saturated where torch wraps."""
    fn = _POWERS[name]
    f = cr.compile(fn)
    with torch.no_grad():
        f(torch.tensor([2, 3, 1, 0, 2, 1, 2, 3, 1, 2], dtype=dtype), torch.tensor([3, 2, 4, 1, 0, 1, 2, 1, 3, 2], dtype=dtype))
        a = torch.tensor([7, 3, 11, -2, 3, 1, -1, -1, 0, 5], dtype=dtype)
        b = torch.tensor([20, 39, 17, -1, 40, -3, -3, -2, 0, 13], dtype=dtype)
        got = f(a, b)
    assert f.captures[0].hits == 1
    assert got.dtype == fn(a, b).dtype and torch.equal(got, fn(a, b)), (got, fn(a, b))


@pytest.mark.parametrize("reduce", [lambda x: x.sum(dtype=torch.int32), lambda x: x.sum(-1, dtype=torch.int32),
                                    lambda x: torch.sum(x, 0, keepdim=True, dtype=torch.int32)],
                         ids=["all", "last axis", "keepdim"])
def test_trap_an_int32_sum_wraps_as_in_torch(reduce):
    # onnxruntime's int32 ReduceSum saturates where torch's wraps: a sum past 2**31 was served as
    # 2147483647 where eager gives 0 (found by a trial). It now sums in int64 and wraps back.
    f = cr.compile(reduce)
    with torch.inference_mode():
        f(torch.tensor([[1, 2, 3, 4]], dtype=torch.int32))
        for x in (torch.full((1, 4), 2**30, dtype=torch.int32), torch.full((1, 4), -2**30 - 7, dtype=torch.int32),
                  torch.tensor([[2**31 - 1, 1, 5, -3]], dtype=torch.int32)):
            assert torch.equal(f(x), reduce(x)), (f(x), reduce(x))
    assert sum(c.hits for c in f.captures) == 3


def test_trap_an_int32_sum_inside_a_branch_is_served_and_wraps():
    # The int64 rewrite of a sum inside torch.cond's branch made a graph onnxruntime refused
    # ("single static assignment": the new values' names repeated the main graph's), so sums
    # there stayed as exported and saturated (an attack on the rewrite, then on its fix).
    def branched(x):
        return torch.cond(x.sum() > 0, lambda t: t.sum(0, dtype=torch.int32) + 1,
                          lambda t: t.sum(0, dtype=torch.int32) - 1, (x,))

    f = cr.compile(branched)
    with torch.inference_mode():
        f(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
        for x in (torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([[2**31 - 1, 1], [1, 1]], dtype=torch.int32)):
            assert torch.equal(f(x), branched(x)), (f(x), branched(x))
    assert sum(c.hits for c in f.captures) == 2


@pytest.mark.parametrize("reduce", [lambda x: x.sum(), lambda x: x.sum(-1), lambda x: torch.sum(x, 0, keepdim=True),
                                    lambda x: x.to(torch.int32).sum(-1), lambda x: (x > 0).sum(-1) + x.sum(-1)],
                         ids=["all", "last axis", "keepdim", "int32 to int64", "bool and int64"])
def test_trap_an_int64_sum_is_exact_and_wraps_as_in_torch(reduce):
    # onnxruntime's int64 ReduceSum accumulates in double: past 2**53 a sum lost its last digits
    # (2**53 + 1 + 1 served as 2**53) and past 2**63 it saturated where torch wraps.
    f = cr.compile(reduce)
    with torch.inference_mode():
        f(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
        for x in (torch.tensor([[2**53 + 1, 1, 0, 0], [2**62, 2**62, 2**62, 5]]),
                  torch.tensor([[-2**63, -1, 2**40 + 3, 3], [2**53 - 1, 2**53 - 1, -7, 2**31 - 1]]),
                  torch.tensor([[2**31 - 1] * 4, [-2**31] * 4])):
            assert torch.equal(f(x), reduce(x)), (f(x), reduce(x))
    assert sum(c.hits for c in f.captures) == 3


@pytest.mark.parametrize("reduce", [lambda x: x.prod(), lambda x: x.prod(-1), lambda x: x.prod(0, keepdim=True),
                                    lambda x: x.to(torch.int32).prod(-1, dtype=torch.int32)],
                         ids=["all", "last axis", "keepdim", "int32"])
def test_trap_an_integer_product_is_exact_or_eager(reduce):
    # onnxruntime's integer ReduceProd multiplies in double: 3**39 * 3 was served as 2**63 - 1,
    # an int32 product past 2**31 as 2147483647, where torch's are exact and wrap. Products
    # below 2**53 are exact in double and served; a larger one runs eagerly, a call at a time.
    f = cr.compile(reduce)
    with torch.inference_mode():
        f(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
        served = torch.tensor([[2**20, 2**10, 2**2, -1], [-3, 1, 1, 2**10 + 1]])  # 3 * (2**42 + 2**32) in all
        assert torch.equal(f(served), reduce(served))
        for x in (torch.tensor([[3**39, 3, 1, 1], [1, 1, 1, 1]]), torch.tensor([[2**62, 4, 5, 1], [-2**63, 1, 1, -1]]),
                  torch.tensor([[2**40, 2**40, 0, 2**40], [100000, 100000, 7, 1]])):
            assert torch.equal(f(x), reduce(x)), (f(x), reduce(x))
        assert torch.equal(f(served), reduce(served))
    assert sum(c.hits for c in f.captures) >= 2


@pytest.mark.parametrize("narrow", [torch.int32, torch.int16, torch.int8, torch.uint8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_trap_a_float_cast_to_int64_then_narrower_wraps_as_in_torch(dtype, narrow):
    # onnxruntime merges Cast(float -> int64) and Cast(int64 -> int32) into one float -> int32
    # cast, which saturates: 2**32 + 5 was served as 2147483647 where torch wraps it to 5.
    convert = lambda x: x.to(torch.int64).to(narrow)  # noqa: E731
    f = cr.compile(convert)
    with torch.inference_mode():
        f(torch.arange(8, dtype=dtype))
        x = torch.tensor([-2.0**32, 2.0**32 + 256.0, 3e9, 300.0, -129.0, 70000.0, -2.0**40, 65535.0], dtype=dtype)
        assert torch.equal(f(x), convert(x)), (f(x), convert(x))
    assert f.captures[0].hits == 1


_INTO_NARROW = {
    "full uint8": lambda x: torch.full((2, x.shape[-1]), x.shape[-1], dtype=torch.uint8),
    "clamp uint8": lambda x: (x > 0).to(torch.uint8).clamp(max=x.shape[-1]),
    "masked_fill uint8": lambda x: (x > 0).to(torch.uint8).masked_fill(x > 1, x.shape[-1]),
    "new_full int16": lambda x: x.new_full((2,), x.shape[-1] * 200, dtype=torch.int16),
    "full float16": lambda x: torch.full((2,), x.shape[-1] * 400, dtype=torch.float16) + x[0, :2].half(),
    "where uint8": lambda x: torch.where(x > 0, (x > 0).to(torch.uint8), x.shape[-1]),
    "fill_ uint8": lambda x: (x > 0).to(torch.uint8).fill_(x.shape[-1]),
}


@pytest.mark.parametrize("name", _INTO_NARROW)
def test_trap_a_size_too_large_for_its_dtype_raises_as_in_torch(name):
    # A size written into a narrower dtype: torch raises ("value cannot be converted to type
    # uint8_t without overflow"); the graph wrapped it (300 served as 44) or made it inf (a
    # trial). The call now raises torch's error, and the graph serves the next one.
    fn = _INTO_NARROW[name]
    f = cr.compile(fn)
    with torch.inference_mode():
        for n in (10, 12, 14):
            f(torch.randn(2, n))
        before = sum(c.hits for c in f.captures)
        assert before == 1
        big = torch.randn(2, 300)
        with pytest.raises(RuntimeError, match="overflow"):
            fn(big)
        with pytest.raises(RuntimeError, match="overflow"):
            f(big)
        small, served = torch.randn(2, 20), sum(c.hits for c in f.captures)
        assert torch.equal(f(small), fn(small))
    assert sum(c.hits for c in f.captures) == served + 1


def test_trap_a_number_passed_in_too_large_for_its_dtype_raises_as_in_torch():
    fn = lambda x, k: torch.full_like(x, k, dtype=torch.int8)  # noqa: E731
    f = cr.compile(fn)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        for k in (3, 5, 7):
            f(x, k)
        with pytest.raises(RuntimeError, match="overflow"):
            fn(x, 300)
        with pytest.raises(RuntimeError, match="overflow"):
            f(x, 300)
        served = sum(c.hits for c in f.captures)
        assert torch.equal(f(x, 9), fn(x, 9))
    assert sum(c.hits for c in f.captures) == served + 1
