"""The fast hit paths: the flat-call check and the reused per-thread IOBinding.

Both exist for speed only, so every test here checks that they decide and compute exactly what
the general path and eager do: fresh outputs on every call, inputs read as torch holds them
(strided, negated views, empty), and every key change still caught.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import Counted, current, flat_hit

import clika_runtime as cr

State = cr.CompiledFunction.State


def _affine(x):
    return x * 2 + 1


@pytest.fixture(scope="module")
def affine():
    target = Counted(_affine)
    f = cr.compile(target)
    f(torch.randn(4, 3))
    return f, target


def test_small_static_graphs_take_the_reused_binding_and_the_flat_hit(affine):
    f, _ = affine
    assert current(f).parts.runner.path == "reused binding"
    assert flat_hit(f) is not None


def test_every_call_returns_fresh_outputs(affine):
    # The binding keeps its output buffers between runs: what a call returned must not change.
    f, target = affine
    calls = target.calls
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    y1 = f(x1)
    y2 = f(x2)
    torch.testing.assert_close(y1, _affine(x1))
    torch.testing.assert_close(y2, _affine(x2))
    assert y1.data_ptr() != y2.data_ptr()
    assert target.calls == calls


def test_the_same_input_written_in_place_is_read_again(affine):
    # The binding is not redone when the input's memory is the one already bound: its new values
    # must still be what the run reads.
    f, target = affine
    calls = target.calls
    x = torch.randn(4, 3)
    f(x)
    x.mul_(3)
    torch.testing.assert_close(f(x), _affine(x))
    assert target.calls == calls


def test_an_input_whose_data_was_replaced_is_bound_again(affine):
    # The same tensor object over new memory (``x.data = ...``): the binding must follow the memory.
    f, target = affine
    calls = target.calls
    x = torch.randn(4, 3)
    f(x)
    x.data = torch.randn(4, 3)
    torch.testing.assert_close(f(x), _affine(x))
    y = torch.randn(4, 3)
    torch.testing.assert_close(f(y), _affine(y))
    torch.testing.assert_close(f(x), _affine(x))
    assert target.calls == calls


def test_outputs_are_not_the_bound_buffers(affine):
    # Outputs are bound once to buffers the next run writes: a returned tensor must be a copy.
    f, _ = affine
    x = torch.randn(4, 3)
    y = f(x)
    kept = y.clone()
    f(torch.randn(4, 3))
    torch.testing.assert_close(y, kept)
    y.fill_(7)  # the caller owns it: writing it changes nothing served
    torch.testing.assert_close(f(x), _affine(x))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4).t(),  # strided
        lambda: torch.randn(6, 3)[2:],  # storage offset
        lambda: torch.randn(1, 3).expand(4, 3),  # stride 0
        lambda: torch.randn(4, 3, dtype=torch.complex64).conj().imag,  # negative bit set
    ],
    ids=["transposed", "offset", "expanded", "negated-view"],
)
def test_inputs_are_read_as_torch_holds_them(affine, make):
    f, target = affine
    calls = target.calls
    x = make()
    torch.testing.assert_close(f(x), _affine(x.clone()))
    assert target.calls == calls, "the call should have been served"


def test_empty_inputs_are_served():
    f = cr.compile(_affine)
    f(torch.zeros(0, 3))
    assert current(f).parts.runner.path == "reused binding"
    assert f(torch.zeros(0, 3)).shape == (0, 3)
    assert f.state is State.Compiled and f.recapture_count == 0


def test_what_the_flat_hit_refuses_the_general_path_decides(affine):
    f, target = affine
    before = f.recapture_count
    x = torch.randn(4, 3)
    # A Parameter (a tensor subclass) and a tensor needing grad under no_grad are served.
    with torch.no_grad():
        torch.testing.assert_close(f(torch.nn.Parameter(x)), _affine(x))
        torch.testing.assert_close(f(x.clone().requires_grad_()), _affine(x))
    calls = target.calls
    # Under grad mode, an input requiring grad stays eager (differentiable).
    out = f(x.clone().requires_grad_())
    assert out.requires_grad and target.calls == calls + 1
    # A new dtype is a new key: a re-capture, with the reason.
    f(x.double())
    assert f.recapture_count == before + 1 and "float64" in f.recapture_reasons[-1]


class ByMode(torch.nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x + 1


def _scaled(x, mask=None, mode="double", scale=2):
    y = x * scale if mode == "double" else x + scale
    return y if mask is None else y * mask


def test_keyword_calls_and_simple_constants_take_the_flat_hit():
    # (Counted also counts the exporter's trace: served calls are checked as "no new calls".)
    target = Counted(_scaled)
    f = cr.compile(target)
    x, m = torch.randn(4, 3), torch.rand(4, 3)
    f(x, mask=m, mode="inc")  # canonical form (x, m, "inc"): a tensor, a tensor, a constant
    assert flat_hit(f) is not None
    calls = target.calls
    torch.testing.assert_close(f(x, mask=m, mode="inc"), _scaled(x, m, "inc"))
    torch.testing.assert_close(f(x, m, "inc"), _scaled(x, m, "inc"))
    assert target.calls == calls
    # Each constant is compared by type and value: a new one is a new key, never a wrong hit.
    torch.testing.assert_close(f(x, m, "double"), _scaled(x, m, "double"))
    torch.testing.assert_close(f(x, m, "inc", 3), _scaled(x, m, "inc", 3))
    torch.testing.assert_close(f(x, m, "inc", True), _scaled(x, m, "inc", True))
    torch.testing.assert_close(f(x, None, "inc"), _scaled(x, None, "inc"))
    assert f.recapture_count == 4
    calls = target.calls
    torch.testing.assert_close(f(x, mask=m, mode="inc"), _scaled(x, m, "inc"))
    assert target.calls == calls


def test_float_constants_are_left_to_the_general_path():
    target = Counted(_scaled)
    f = cr.compile(target, specialize=True)
    x = torch.randn(4, 3)
    f(x, None, "double", 0.5)
    assert flat_hit(f) is None
    calls = target.calls
    torch.testing.assert_close(f(x, None, "double", 0.5), x * 0.5)
    assert target.calls == calls
    torch.testing.assert_close(f(x, None, "double", -0.0), x * -0.0)
    assert f.recapture_count == 1


def test_training_flag_flips_are_seen_by_the_flat_hit():
    model = ByMode().eval()
    f = cr.compile(model)
    x = torch.randn(4, 3)
    f(x)
    model.train()
    torch.testing.assert_close(f(x), x * 2)
    assert f.recapture_count == 1 and "training" in f.recapture_reasons[0]
    model.eval()
    torch.testing.assert_close(f(x), x + 1)
    model.train()
    torch.testing.assert_close(f(x), x * 2)
    assert f.recapture_count == 1 and f.state is State.Compiled


def test_large_or_dynamic_outputs_take_the_numpy_path():
    large = cr.compile(lambda x: x.repeat(64, 1))  # 64 KiB and more out: copying out would cost
    large(torch.randn(300, 4))
    assert current(large).parts.runner.path == "numpy"
    dynamic = cr.compile(_affine, dynamic=True)
    dynamic(torch.randn(4, 3))
    assert current(dynamic).parts.runner.path == "numpy"
    torch.testing.assert_close(dynamic(torch.randn(7, 3)).shape, torch.Size([7, 3]))


def test_threads_each_bind_their_own_inputs(affine):
    f, _ = affine
    inputs = [torch.full((4, 3), float(i)) for i in range(200)]

    def call(x):
        with torch.no_grad():
            return f(x)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, inputs, timeout=300))
    for x, y in zip(inputs, results):
        torch.testing.assert_close(y, _affine(x))


def test_a_loaded_graph_returns_fresh_outputs_too(affine, tmp_path):
    f = cr.compile(_affine)
    f(torch.randn(4, 3))
    served = cr.load(f.take_graph().save(tmp_path / "affine.onnx"))
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    y1, y2 = served(x1), served(x2)
    torch.testing.assert_close(y1, _affine(x1))
    torch.testing.assert_close(y2, _affine(x2))


def test_without_the_private_iobinding_the_public_paths_serve(monkeypatch):
    # An onnxruntime whose C-level module moved: the reused binding must not be chosen.
    from serving import runners

    monkeypatch.setattr(runners, "_C", None)
    f = cr.compile(_affine)
    f(torch.randn(4, 3))
    assert current(f).parts.runner.path == "numpy"
    x = torch.randn(4, 3)
    torch.testing.assert_close(f(x), _affine(x))


def _add(x, y):
    return x + y


@pytest.mark.parametrize("large", [False, True], ids=["reused-binding", "numpy"])
def test_the_guard_refuses_tensors_the_graph_was_not_made_for(large):
    # The flat hit leaves dtype, device and shape to the capture's guard: it must say no rather
    # than let onnxruntime read memory it would misread; the call then takes the general path.
    rows = 5000 if large else 4  # 5000 x 4 floats out: past the reused binding's copy limit
    f = cr.compile(_add)
    f(torch.randn(rows, 4), torch.randn(rows, 4))
    capture = current(f)
    assert capture.parts.runner.path == ("numpy" if large else "reused binding")
    guard = capture.guard
    x, y = torch.randn(rows, 4), torch.randn(rows, 4)
    assert guard.check([x, y]) is None and guard.check([x.t().contiguous().t(), y[:, :]]) is None
    torch.testing.assert_close(capture.run([x, y]), x + y)
    assert guard.check([x.double(), y]).kind == "dtype"
    assert guard.check([x, y.int()]).kind == "dtype"
    assert guard.check([torch.randn(rows + 1, 4), y]).kind == "size"
    assert guard.check([x, torch.randn(rows, 4, 1)]).kind == "rank"
    assert guard.check([torch.empty(rows, 4, device="meta"), y]).kind == "device"
    assert guard.check([x]).kind == "count"
    calls = f.recapture_count
    torch.testing.assert_close(f(x.double(), y.double()), x.double() + y.double())  # a new key, not a misread
    assert f.recapture_count == calls + 1


def test_dense_copies_of_strided_inputs_live_until_the_run():
    # Each strided input is copied dense and bound by pointer; a copy freed before the run would
    # let onnxruntime read reused memory. Through the flat hit and the general path (a dict).
    flat, nested = cr.compile(_add), cr.compile(lambda d: d["x"] + d["y"])
    flat(torch.randn(4, 4), torch.randn(4, 4))
    nested({"x": torch.randn(4, 4), "y": torch.randn(4, 4)})
    assert current(flat).parts.runner.path == current(nested).parts.runner.path == "reused binding"
    for _ in range(20):
        x, y = torch.randn(4, 4).t(), torch.randn(4, 4).t()
        torch.testing.assert_close(flat(x, y), x + y)
        torch.testing.assert_close(nested({"x": x, "y": y}), x + y)


def test_a_new_rank_with_dynamic_axes_is_a_new_key_not_an_error():
    # The guard indexes axes; the flat hit must compare ranks before it runs the guard.
    f = cr.compile(_affine, dynamic_axes={"x": {0: "batch"}})
    f(torch.randn(4, 3))
    assert flat_hit(f) is not None
    torch.testing.assert_close(f(torch.randn(6, 3)).shape, torch.Size([6, 3]))
    x = torch.randn(4)
    torch.testing.assert_close(f(x), _affine(x))
    assert f.recapture_count == 1 and "rank" in f.recapture_reasons[0]
