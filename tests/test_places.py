"""place: what onnxruntime can give is used, what it cannot is an error at compile() time."""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch
from conftest import current

import clika_runtime as cr
import serving
from clika_runtime import PlaceError

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.parametrize("place", [None, "cpu", torch.device("cpu"), "CPUExecutionProvider",
                                   ["CPUExecutionProvider"], [("CPUExecutionProvider", {})]])
def test_cpu_places_resolve(place):
    resolved = serving.resolve(place)
    assert resolved.primary == "CPUExecutionProvider" and resolved.device == "cpu"


def test_cuda_index_and_options_resolve_when_cuda_is_there():
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="onnxruntime-gpu"):
            serving.resolve("cuda:1")
        return
    resolved = serving.resolve("cuda:1")
    assert resolved.primary == "CUDAExecutionProvider" and resolved.device_id == 1


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA: the missing-provider error cannot happen")
@pytest.mark.parametrize("place", ["cuda", "cuda:0", torch.device("cuda", 0), "CUDAExecutionProvider",
                                   "TensorrtExecutionProvider"])
def test_a_missing_provider_is_an_error_at_compile_time(place):
    with pytest.raises(PlaceError, match=r"not available in this onnxruntime .*available: .*CPUExecutionProvider.*onnxruntime-gpu"):
        cr.compile(lambda x: x, place=place)


@pytest.mark.parametrize("place", ["gpu", "cuda:x", 3, [("CPUExecutionProvider", "threads")]])
def test_malformed_places_are_rejected(place):
    with pytest.raises(PlaceError, match="place"):
        cr.compile(lambda x: x, place=place)


def test_load_checks_the_place_too(tmp_path):
    f = cr.compile(lambda x: x + 1)
    f(torch.zeros(2))
    path = f.take_graph().save(tmp_path / "g.onnx")
    assert cr.load(path, place="cpu").providers == ["CPUExecutionProvider"]
    if not HAS_CUDA:
        with pytest.raises(PlaceError, match="CUDAExecutionProvider"):
            cr.load(path, place="cuda")


def test_bfloat16_float16_bool_int_zero_d_and_non_contiguous_inputs_are_served():
    def fn(a, b, c, d, e):
        # onnxruntime's CPU kernels lack bfloat16 arithmetic: bfloat16 crosses the boundary via Cast
        return (a.float() * 2).bfloat16(), b + 1, ~c, d * 3, e.sum(), e.t() * 1

    f = cr.compile(fn)
    make = lambda: (torch.randn(3, dtype=torch.bfloat16), torch.randn(3, dtype=torch.float16),  # noqa: E731
                    torch.rand(3) > 0.5, torch.randint(0, 5, (3,)), torch.randn(4, 3).t())
    f(*make())
    args = make()
    assert not args[4].is_contiguous()
    for got, want in zip(f(*args), fn(*args)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    assert f.state is cr.CompiledFunction.State.Compiled and f.recapture_count == 0
    g = cr.compile(lambda x: x * 2)
    g(torch.tensor(3.0))
    torch.testing.assert_close(g(torch.tensor(5.0)), torch.tensor(10.0))


def test_optimize_false_serves_the_graph_as_exported_with_basic_session_optimisation():
    def fn(x):
        return (x * 2 + 0) * 1 + torch.zeros(3).sum()

    plain = cr.compile(fn, optimize=False)
    tuned = cr.compile(fn)
    x = torch.randn(3)
    plain(x), tuned(x)
    torch.testing.assert_close(plain(x), fn(x))
    assert current(plain).parts.runner.session.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert current(tuned).parts.runner.session.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert len(plain.take_graph().model_proto.graph.node) > len(tuned.take_graph().model_proto.graph.node)


def test_session_threads_follow_torch_unless_configured():
    f = cr.compile(lambda x: x + 1)
    f(torch.zeros(2))
    assert current(f).parts.runner.session.get_session_options().intra_op_num_threads == torch.get_num_threads()
    cr.config.intra_op_threads = 1
    g = cr.compile(lambda x: x - 1)
    g(torch.zeros(2))
    assert current(g).parts.runner.session.get_session_options().intra_op_num_threads == 1
