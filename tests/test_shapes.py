"""What a graph may vary over: dynamic, dynamic_axes, signature, specialize, and named dims."""

from __future__ import annotations

import re
import warnings

import onnx
import pytest
import torch
from conftest import Counted, TinyNet

import clika_runtime as cr
from clika_runtime import SignatureError, SignatureValueError, TensorSpec

State = cr.CompiledFunction.State
_EXPORTER_SYMBOL = re.compile(r"\b[su]\d+\b")


def _all_dim_params(model: onnx.ModelProto) -> set[str]:
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    return {d.dim_param for v in values for d in v.type.tensor_type.shape.dim if d.dim_param}


def _graph_dims(f) -> dict[str, list]:
    graph = f.take_graph()
    return {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in list(graph.model_proto.graph.input) + list(graph.model_proto.graph.output)
    }


# ------------------------------------------------------------------------------------------ dynamic


def test_dynamic_none_accumulates_drifted_axes_and_keeps_hidden_size_static():
    model = TinyNet().eval()
    f = cr.compile(model)
    with torch.no_grad():
        f(torch.randn(2, 5, 8))
        f(torch.randn(2, 9, 8))  # sequence drifts
        f(torch.randn(4, 9, 8))  # then batch
        out = f(torch.randn(3, 11, 8))
        torch.testing.assert_close(out.shape, torch.Size([3, 11, 8]))
    assert f.recapture_count == 2
    dims = _graph_dims(f)
    assert dims["x"] == ["x_dim0", "x_dim1", 8]  # the hidden size never became dynamic


def test_dynamic_true_makes_every_axis_dynamic_from_the_first_capture():
    target = Counted(lambda x: x.softmax(-1))
    f = cr.compile(target, dynamic=True)
    f(torch.randn(2, 3))
    calls = target.calls
    for shape in [(5, 7), (1, 1), (9, 2), (1, 1)]:
        x = torch.randn(shape)
        torch.testing.assert_close(f(x), x.softmax(-1))
    # Sizes 1 get a graph of their own (torch.export traces the dynamic one for sizes from 2):
    # one eager call and its trace, then served.
    assert target.calls == calls + 2 and f.recapture_count == 1 and len(f.captures) == 2
    assert _graph_dims(f)["x"] == ["x_dim0", "x_dim1"]


def test_dynamic_true_keeps_axes_the_exporter_proves_static_guarded():
    weight = torch.randn(4, 3)
    f = cr.compile(lambda x: x @ weight, dynamic=True)  # x's last axis must be 4
    f(torch.randn(2, 4))
    f(torch.randn(7, 4))
    assert f.recapture_count == 0
    assert f.take_graph().dynamic_axes["x"] == {0: "x_dim0"}  # axis 1 proven static

    def by_rows(x):  # a branch on a size: the exporter pins axis 0 to 4
        return x.sum(0) if x.shape[0] == 4 else x.mean(0)

    g = cr.compile(by_rows, dynamic=True)
    g(torch.randn(4, 3))
    x = torch.randn(5, 3)
    torch.testing.assert_close(g(x), x.mean(0))  # drift on the pinned axis: re-captured, right branch
    assert g.recapture_reasons == ["shape drift: input 'x' axis 0: 4 -> 5 (an axis the exporter traces at one size "
                                   "only: a graph for this size beside the others)"]
    x = torch.randn(4, 2)
    torch.testing.assert_close(g(x), by_rows(x))


def test_dynamic_false_puts_shapes_in_the_key():
    target = Counted(lambda x: x + 1)
    f = cr.compile(target, dynamic=False)
    for n in (2, 3, 2, 3):
        torch.testing.assert_close(f(torch.zeros(n)), torch.ones(n))
    assert f.recapture_count == 1
    assert f.recapture_reasons == ["input 'x' changed: float32 rank 1 on cpu shape (2,) -> float32 rank 1 on cpu shape (3,)"]
    assert _all_dim_params(f.take_graph().model_proto) == set()


# ------------------------------------------------------------------------------------- dynamic_axes


def test_dynamic_axes_dict_form_names_dims_for_inputs_and_outputs():
    model = TinyNet().eval()
    f = cr.compile(model, dynamic_axes={"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"},
                                        "output": {1: "seq"}})
    with torch.no_grad():
        f(torch.randn(2, 5, 8), torch.ones(2, 5))
        f(torch.randn(3, 7, 8), torch.ones(3, 7))
    assert f.recapture_count == 0
    dims = _graph_dims(f)
    assert dims == {"x": ["batch", "seq", 8], "mask": ["batch", "seq"], "output": ["batch", "seq", 8]}


def test_dynamic_axes_list_form():
    f = cr.compile(lambda x: x.cumsum(0), dynamic_axes={"x": [0]})
    f(torch.randn(3, 2))
    f(torch.randn(6, 2))
    assert f.recapture_count == 0
    assert _graph_dims(f)["x"] == ["x_dim0", 2]


def test_equal_dim_names_mean_equal_sizes():
    f = cr.compile(lambda a, b: a.sum() + b.sum(), dynamic_axes={"a": {0: "n"}, "b": {0: "n"}})
    f(torch.ones(3), torch.ones(3))
    with pytest.raises(SignatureValueError, match=r"input 'b' axis 0: dim 'n' is 4, but input 'a' axis 0 gave it 3"):
        f(torch.ones(3), torch.ones(4))


def test_unknown_dynamic_axes_name_lists_the_valid_names():
    f = cr.compile(lambda x: x + 1, dynamic_axes={"y": [0]})
    with pytest.raises(SignatureValueError, match=r"\['y'\] match no input or output; inputs: \['x'\], outputs: \['output'\]"):
        f(torch.ones(2))


# ---------------------------------------------------------------------------------------- signature


def test_signature_is_dynamic_from_the_first_capture_and_names_inputs():
    target = Counted(lambda a, b: a @ b)
    f = cr.compile(target, signature=[TensorSpec(["n", 4], torch.float32, "lhs"), TensorSpec([4, None], name="rhs")])
    f(torch.randn(2, 4), torch.randn(4, 3))
    calls = target.calls
    torch.testing.assert_close(f(torch.ones(5, 4), torch.ones(4, 6)), torch.full((5, 6), 4.0))
    assert target.calls == calls
    assert f.input_names == ["lhs", "rhs"]
    assert _graph_dims(f)["lhs"] == ["n", 4]


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.ones(2, 4),), SignatureError, r"declares 2 tensor inputs, the call has 1"),
        ((torch.ones(2, 4, dtype=torch.float64), torch.ones(4, 3)), SignatureError,
         r"input 'lhs': expected dtype torch.float32, got torch.float64"),
        ((torch.ones(2, 4, 1), torch.ones(4, 3)), SignatureError, r"input 'lhs': expected rank 2 \['n', 4\], got shape \(2, 4, 1\)"),
        ((torch.ones(2, 5), torch.ones(4, 3)), SignatureValueError, r"input 'lhs' axis 1: expected size 4 \['n', 4\], got 5"),
    ],
)
def test_a_call_breaking_the_signature_raises_before_anything_runs(args, error, message):
    target = Counted(lambda a, b=None: a)
    f = cr.compile(target, signature=[TensorSpec(["n", 4], torch.float32, "lhs"), TensorSpec([4, None], name="rhs")])
    with pytest.raises(error, match=message):
        f(*args)
    assert target.calls == 0
    assert issubclass(SignatureError, TypeError) and issubclass(SignatureValueError, ValueError)


# ------------------------------------------------------------------------------------ sizes 0 and 1


def test_first_capture_at_size_one_then_drift_serves_one_and_other_sizes():
    target = Counted(lambda x, y: (x + y).sum(0))
    f = cr.compile(target)
    f(torch.randn(1, 3), torch.randn(1, 3))
    f(torch.randn(4, 3), torch.randn(4, 3))  # drift: axis 0 dynamic from size 2; the size-1 graph stays
    calls = target.calls
    for n in (1, 6, 1):
        x, y = torch.randn(n, 3), torch.randn(n, 3)
        torch.testing.assert_close(f(x, y), (x + y).sum(0))
    assert target.calls == calls and f.recapture_count == 1 and len(f.captures) == 2


def test_size_one_after_a_dynamic_capture_gets_a_graph_traced_at_one():
    target = Counted(lambda x: (x * 2).sum(0))
    f = cr.compile(target)
    for n in (4, 6, 1):
        f(torch.randn(n, 3))
    calls = target.calls
    for n in (1, 5):
        x = torch.randn(n, 3)
        torch.testing.assert_close(f(x), (x * 2).sum(0))
    # Size 1 is traced on its own (torch.export assumed sizes from 2), as torch.compile does.
    assert target.calls == calls and len(f.captures) == 2, f.recapture_reasons


class _SizeOneBranch(torch.nn.Module):
    def forward(self, x):
        return x.clamp(min=0) * 2 if x.shape[0] == 1 else x * 2


class _LargeBatchBranch(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) if x.shape[0] > 4 else x


@pytest.mark.parametrize("model, traced, other", [(_SizeOneBranch, (4, 6), 1), (_LargeBatchBranch, (2, 3), 6)],
                         ids=["size_one", "past_a_range"])
def test_trap_one_agreeing_call_at_an_untraced_size_does_not_vouch_for_the_next(model, traced, other):
    # Data on which both sides agree (all positive) used to verify the graph at that size; the
    # next call there, with negative data, was served the side the trace took.
    m = model().eval()
    f = cr.compile(m)
    with torch.no_grad():
        for n in traced:
            f(torch.rand(n, 3))
        for x in (torch.rand(other, 3), -torch.rand(other, 3)):  # the sides agree on the first only
            torch.testing.assert_close(f(x), m(x))


def test_zero_size_axes_work():
    f = cr.compile(lambda x: x * 2 + 1, dynamic=True)
    f(torch.randn(3, 2))
    out = f(torch.randn(0, 2))
    assert out.shape == (0, 2)
    g = cr.compile(lambda x: x.sum(-1))
    torch.testing.assert_close(g(torch.randn(2, 0)), torch.zeros(2))
    torch.testing.assert_close(g(torch.randn(2, 0)), torch.zeros(2))


# ---------------------------------------------------------------------------------------- dim names


def test_no_exporter_symbol_reaches_a_saved_graph(tmp_path):
    model = TinyNet().eval()
    f = cr.compile(model, dynamic=True)
    with torch.no_grad():
        f(torch.randn(2, 5, 8), torch.ones(2, 5))
    path = f.take_graph().save(tmp_path / "m.onnx")
    model_proto = onnx.load(str(path))
    names = _all_dim_params(model_proto)
    assert names and not any(_EXPORTER_SYMBOL.search(n) for n in names), names
    assert {"x_dim0", "x_dim1"} <= names


# ---------------------------------------------------------------------------------------- specialize


def _scale_rows(x, k, alpha):
    return x[:k] * alpha


def test_specialize_true_bakes_every_number():
    f = cr.compile(_scale_rows, specialize=True)
    x = torch.randn(6, 2)
    for k in (2, 3, 2):
        torch.testing.assert_close(f(x, k, 0.5), _scale_rows(x, k, 0.5))
    assert f.recapture_count == 1
    assert f.input_names == ["x"]


def test_specialize_false_lifts_ints_from_the_first_capture_floats_stay_baked():
    target = Counted(_scale_rows)
    f = cr.compile(target, specialize=False)
    x = torch.randn(6, 2)
    f(x, 2, 0.5)
    assert f.input_names == ["x", "k"]
    calls = target.calls
    for k in (3, 5, 1):
        torch.testing.assert_close(f(x, k, 0.5), _scale_rows(x, k, 0.5))
    assert target.calls == calls and f.recapture_count == 0
    torch.testing.assert_close(f(x, 3, 2.0), _scale_rows(x, 3, 2.0))  # a float change re-captures
    assert f.recapture_reasons == ["static value changed: 'alpha' 0.5 -> 2.0"]


def test_specialize_none_lifts_an_int_when_its_value_changes():
    target = Counted(lambda x, n: x.repeat(n, 1) + n)
    f = cr.compile(target)
    x = torch.randn(1, 2)
    f(x, 2)
    assert f.input_names == ["x"]
    f(x, 3)
    assert f.recapture_reasons == ["static value changed: 'n' 2 -> 3; it becomes a graph input"]
    assert f.input_names == ["x", "n"]
    calls = target.calls
    for n in (4, 1, 7):
        torch.testing.assert_close(f(x, n), x.repeat(n, 1) + n)
    assert target.calls == calls and f.recapture_count == 1


def test_bools_and_strings_always_stay_static():
    f = cr.compile(lambda x, flag, mode: x + 1 if flag and mode == "a" else x, specialize=False)
    x = torch.zeros(2)
    torch.testing.assert_close(f(x, True, "a"), x + 1)
    torch.testing.assert_close(f(x, False, "a"), x)
    assert f.input_names == ["x"] and f.recapture_count == 1


def test_an_int_the_exporter_cannot_lift_stays_baked_with_the_reason_recorded():
    def repeat_double(x, n):
        for _ in range(n):  # a Python loop over the number: the exporter pins it to its example value
            x = x * 2
        return x

    f = cr.compile(repeat_double, specialize=False)
    x = torch.ones(2)
    for n in (2, 3, 2, 1):
        torch.testing.assert_close(f(x, n), x * 2**n)
    assert f.state is State.Compiled and f.input_names == ["x"]
    assert "stay baked: the exporter could not lift them" in f.capture_notes[0], f.capture_notes
    assert len(f.recapture_reasons) == f.recapture_count


def test_a_lifted_int_is_guarded_by_the_range_the_exporter_assumed():
    f = cr.compile(lambda x, k: x[:k] * 2, specialize=False)
    x = torch.arange(4.0)
    for k in (3, 2, 4, 1, 0):
        torch.testing.assert_close(f(x, k), x[:k] * 2)
    assert f.input_names == ["x", "k"]


def test_axes_the_exporter_cannot_make_dynamic_are_captured_static_with_the_reason():
    def attend(q):  # a size-dependent bool argument: the exporter rejects it once the axis is dynamic
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=q.shape[2] > 1)

    f = cr.compile(attend)
    for seq in (4, 6, 6, 8):
        q = torch.randn(1, 2, seq, 8)
        torch.testing.assert_close(f(q), attend(q), rtol=1e-4, atol=1e-5)
    assert f.state is State.Compiled
    assert any("could not be exported dynamic" in n and "captured them static" in n for n in f.capture_notes)
    assert f.take_graph().dynamic_axes.get("q", {}) == {}


class _SingleSampleFastPath(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] == 1 else x * 3


def test_trap_an_all_zero_call_does_not_verify_a_flipped_branch():
    # Zeros agree with both sides: recorded as verified, later size-1 calls got the other branch.
    model = _SingleSampleFastPath().eval()
    f = cr.compile(model)
    with torch.no_grad():
        for batch in (4, 5, 6):
            f(torch.ones(batch, 2))
        torch.testing.assert_close(f(torch.zeros(1, 2)), torch.zeros(1, 2))  # a warm-up frame
        for _ in range(2):
            torch.testing.assert_close(f(torch.ones(1, 2)), torch.full((1, 2), 2.0))
        torch.testing.assert_close(f(torch.ones(7, 2)), torch.full((7, 2), 3.0))


def test_trap_sizes_0_and_1_on_two_dynamic_axes_settle_instead_of_recapturing_for_good():
    # Each combination of batch and length in {0/1, the rest} is a graph; with four kept per key
    # and the oldest dropped first, the general graph went, the sweep drifted again every round
    # and the budget ran out (Fallback) though every answer was right.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    f = cr.compile(model)
    with torch.no_grad():
        for sweep in range(2):
            if sweep:
                captured = f.recapture_count
            for batch in (2, 1, 3):
                for length in (3, 0, 1, 2, 4, 5):
                    x = torch.randn(batch, length, 4)
                    torch.testing.assert_close(f(x), model(x))
    assert f.state is State.Compiled and f.recapture_count == captured, f.recapture_reasons


class _Recurrent(torch.nn.Module):
    """A cell stepped over the sequence in Python: torch.export unrolls the loop, so the sequence
    axis is traced at one size whatever it is asked (as it does for ``nn.GRU``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.GRUCell(4, 5)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 5)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return h


@pytest.mark.parametrize("dynamic", [None, True])
def test_trap_an_axis_the_exporter_traces_at_one_size_serves_per_size_and_never_falls_back(dynamic):
    """Each re-capture for a drifted sequence length came back static again, replaced the graph
    before it, and spent the budget: after eight lengths the function fell back to eager for
    good. Now each length gets a graph beside the others; past the budget, a new length runs
    eagerly (said once) while the lengths with graphs stay served."""
    model = _Recurrent().eval()
    target = Counted(model)
    f = cr.compile(target, dynamic=dynamic)
    lengths = list(range(2, 2 + cr.config.recapture_limit + 3))
    with torch.no_grad(), pytest.warns(UserWarning, match="re-capture limit") as said:
        for length in lengths:
            x = torch.randn(3, length, 4)
            torch.testing.assert_close(f(x), model(x))
    assert f.state is State.Compiled and f.fallback_reason is None
    assert sum("re-capture limit" in str(w.message) for w in said) == 1
    pinned = f.recapture_reasons[1:] if dynamic is None else f.recapture_reasons  # None: the first asks dynamic
    assert pinned and all("traces at one size only" in r for r in pinned), f.recapture_reasons
    kept = [c.inputs[0].shape[1] for c in f.captures]
    assert len(kept) == cr.config.cache_size and len(set(kept)) == len(kept)
    before = target.calls
    with torch.no_grad():
        for length in kept:  # served by their graphs
            x = torch.randn(3, length, 4)
            torch.testing.assert_close(f(x), model(x))
    assert target.calls == before


def _shifted(x, mask):
    return x * mask[:, 1:]  # the exporter writes mask's length as an expression of x's: x_dim1 + 1


def test_trap_an_input_whose_length_the_exporter_derives_from_another_serves_every_length():
    """A decoder step's attention mask is one longer than its past: the exporter writes the mask's
    length as ``past + 1``. Such a dim was pinned to its size at capture (the guard compared dim
    names, not arithmetic), so every new length got a graph of its own and, past the budget, ran
    eagerly. The relation is now a condition the guard evaluates: one graph serves every length."""
    target = Counted(_shifted)
    f = cr.compile(target)
    with torch.no_grad():
        for length in range(4, 12):
            x, mask = torch.randn(2, length), torch.rand(2, length + 1)
            torch.testing.assert_close(f(x, mask), _shifted(x, mask))
        assert f.recapture_count == 1 and len(f.captures) == 1, f.recapture_reasons
        calls = target.calls
        x, mask = torch.randn(2, 7), torch.rand(2, 9)  # the relation broken: eager's error, as without a graph
        with pytest.raises(RuntimeError, match="size of tensor a"):
            f(x, mask)
        assert target.calls == calls + 1
    dims = _graph_dims(f)
    assert dims["x"] == [2, "x_dim1"] and dims["mask"][0] == 2 and isinstance(dims["mask"][1], str)


def _span_loss(logits, positions):
    # A question-answering head's loss: positions past the sequence are ignored (ignore_index=seq_len).
    length = logits.shape[1]
    return torch.nn.functional.cross_entropy(logits, positions.clamp(0, length), ignore_index=length)


def test_trap_a_loss_that_ignores_the_sequence_length_stays_dynamic():
    """``ignore_index`` a size: onnxruntime's loss takes it as an attribute, so the axis was
    exported static, every length re-captured, and past the budget the function (its calls
    without labels too) served eagerly for good."""
    target = Counted(_span_loss)
    f = cr.compile(target)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (15, 27, 21, 13, 30, 23, 16, 25, 11, 19):
            logits = torch.randn(3, length, generator=generator)
            positions = torch.tensor([0, length - 1, length + 4])  # the last one past the end: ignored
            torch.testing.assert_close(f(logits, positions), _span_loss(logits, positions))
    assert f.recapture_count == 1 and f.state is State.Compiled, f.recapture_reasons


def _weighted_span_loss(logits, positions, weight):
    length = logits.shape[1]  # onnxruntime's loss takes ignore_index as an attribute: no dynamic length
    return torch.nn.functional.cross_entropy(logits, positions.clamp(0, length), weight=weight[:length],
                                             ignore_index=length)


def test_trap_an_axis_the_export_could_not_make_dynamic_serves_per_size_and_never_falls_back():
    """An axis captured static after its dynamic export failed: each new size re-captured and
    replaced the graph before it, and past the budget the whole function served eagerly for good.
    Each size now gets a graph beside the others; past the budget new sizes run eagerly alone."""
    target = Counted(_weighted_span_loss)
    f = cr.compile(target)
    weight = torch.rand(64)
    lengths = list(range(8, 8 + cr.config.recapture_limit + 3))
    with torch.no_grad(), pytest.warns(UserWarning, match="re-capture limit"):
        for length in lengths:
            logits, positions = torch.randn(3, length), torch.tensor([0, length - 1, length + 4])
            torch.testing.assert_close(f(logits, positions, weight), _weighted_span_loss(logits, positions, weight))
    assert f.state is State.Compiled and f.fallback_reason is None
    kept = [c.inputs[0].shape[1] for c in f.captures]
    calls = target.calls
    with torch.no_grad():
        for length in kept:
            logits, positions = torch.randn(3, length), torch.tensor([0, length - 1, length + 4])
            torch.testing.assert_close(f(logits, positions, weight), _weighted_span_loss(logits, positions, weight))
    assert target.calls == calls


def _features(x, centered):
    spectrum = torch.fft.fftshift(x, dim=-1) if centered else x  # a roll by n // 2: exported static
    return (spectrum * spectrum).cumsum(-1) / x.shape[-1]


def test_trap_an_axis_one_call_form_keeps_static_stays_dynamic_for_the_others():
    """What one call form taught (``centered=True`` cannot export its length dynamic) kept the
    axis static for every form of the function, and through the disk cache for later processes:
    the ``centered=False`` traffic got a graph per length and was rarely served."""
    f = cr.compile(_features)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (64, 80, 64):
            x = torch.randn(2, length, generator=generator)
            torch.testing.assert_close(f(x, True), _features(x, True))
        before = f.recapture_count
        for length in (64, 80, 96, 72, 88, 100, 66, 90):
            x = torch.randn(2, length, generator=generator)
            torch.testing.assert_close(f(x, False), _features(x, False))
    assert f.recapture_count - before <= 2, f.recapture_reasons  # its first capture, one drift


def _keep_seven_tenths(x):
    return x[:, : int(x.shape[1] * 0.7)]


def _ceil_quarter(x):
    return x[:, : -(-x.shape[1] // 4)]


def _area_half(x):
    return torch.nn.functional.interpolate(x.transpose(1, 2), scale_factor=0.5, mode="area")


@pytest.mark.parametrize("fn", [_keep_seven_tenths, _ceil_quarter, _area_half], ids=["int(n*0.7)", "ceil(n/4)", "area"])
def test_trap_a_size_the_trace_computed_as_a_constant_is_not_served_at_other_sizes(fn):
    """torch.export baked a size computed in Python floats (``int(n * 0.7)``, interpolate's
    ``area`` output length) as the number it was at the traced size, and the size arithmetic of
    ``-(-n // 4)`` as its truncation, with the axis left dynamic: the graph from the drift to 16
    served every other length wrong (8 too, which the first capture had verified). A dynamic
    graph is now verified at a second size too (each dynamic axis one shorter) before it serves."""
    f = cr.compile(fn)
    with torch.inference_mode():
        for n in (8, 16, 5, 8, 13, 16, 20, 23, 9):
            x = torch.randn(2, n, 6)
            got, want = f(x), fn(x)
            assert got.shape == want.shape and torch.equal(got, want), (n, got.shape, want.shape)


def _branch_and_seven_tenths(x):
    y = x.clamp(min=0) if x.shape[0] == 1 else x
    return y[:, : int(x.shape[1] * 0.7)].sum(1)


def test_trap_a_baked_size_that_one_size_shorter_cannot_show_is_not_served():
    """``int(n * 0.7)`` is 2 at both 4 and 3: the graph made dynamic from a length-4 call passed
    its second size (one shorter) and served length 9 with the slice of length 2 (0.39 off; a
    trial, with a batch-1 branch beside it). A second size far enough to move such a size is
    checked too."""
    f = cr.compile(_branch_and_seven_tenths)
    with torch.inference_mode():
        for b, n in ((3, 6), (1, 4), (5, 6), (3, 4), (1, 9), (1, 13), (3, 11)):
            x = torch.randn(b, n, 4)
            torch.testing.assert_close(f(x), _branch_and_seven_tenths(x), msg=f"at {(b, n)}")


def _linear_halved(x):
    return torch.nn.functional.interpolate(x, scale_factor=0.5, mode="linear", align_corners=True)


def test_trap_a_graph_that_fails_at_one_size_keeps_serving_the_others_and_its_replacement_is_verified():
    """A dynamic graph verified at 8 and 16 failed in onnxruntime at length 2 (output length 1:
    a GatherND index past the end). It was dropped, and the graph re-captured from the length-2
    call (an axis of 2 had no second size to be verified at) served every other length wrong:
    each output was ``x[..., 0]``, 5.2 off, at the lengths the first graph had verified too."""
    f = cr.compile(_linear_halved)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in (8, 16, 2, 3, 5, 8, 16, 23, 2, 40, 2, 9):
            x = torch.randn(1, 2, n, generator=generator)
            got, want = f(x), _linear_halved(x)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), (n, (got - want).abs().max())
    assert f.recapture_count <= 3, f.recapture_reasons  # the drift, the length-2 graph beside, once each


def test_trap_a_dynamic_graph_first_captured_at_length_two_is_verified_at_another_length():
    """The same graph captured first from a length-2 call, with the axis declared dynamic: one
    verified size, none shorter to check, and every other length served wrong."""
    f = cr.compile(_linear_halved, dynamic_axes={"x": {2: "length"}})
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for n in (2, 3, 8, 2, 17):
            x = torch.randn(1, 2, n, generator=generator)
            got, want = f(x), _linear_halved(x)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), (n, (got - want).abs().max())


def _ceil_quarter_zeros(x):
    return x.new_zeros(-(-x.shape[-1] // 4)) + x.sum()


def test_size_arithmetic_the_graph_computes_is_pythons_floor_division():
    """``-(-n // 4)`` (a ceiling) on a declared dynamic axis: the exporter divided the sizes toward
    zero, one short for every length not a multiple of 4, so the graph was refused and every call
    ran eagerly. Sizes are now divided as Python divides them, and the graph serves every length."""
    f = cr.compile(_ceil_quarter_zeros, dynamic_axes={"x": {1: "n"}})
    with torch.inference_mode():
        for n in (8, 16, 5, 9, 13, 30, 101):
            x = torch.randn(2, n)
            got, want = f(x), _ceil_quarter_zeros(x)
            assert got.shape == want.shape and torch.allclose(got, want), (n, got.shape, want.shape)
    assert f.state is cr.CompiledFunction.State.Compiled, f.fallback_reason
    assert sum(c.hits for c in f.captures) >= 6


def test_trap_a_declared_dynamic_axis_its_graph_cannot_serve_is_captured_per_size():
    """``int(n * 0.7)`` on an axis declared dynamic: torch.export bakes the size, the graph fails
    at a second size, and there was no step left to give up: the function served every call
    eagerly until ``reset()``. The declared axis is now captured static, a graph per size, saying so."""
    f = cr.compile(_keep_seven_tenths, dynamic_axes={"x": {1: "n"}})
    with torch.inference_mode(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for n in (20, 20, 31, 31, 20):
            x = torch.randn(2, n, 6)
            got, want = f(x), _keep_seven_tenths(x)
            assert got.shape == want.shape and torch.equal(got, want), (n, got.shape, want.shape)
    assert f.state is cr.CompiledFunction.State.Compiled, f.fallback_reason
    assert sum(c.hits for c in f.captures) == 3 and len(f.captures) == 2
    assert any("declared dynamic" in note for note in f.capture_notes), f.capture_notes
    assert any("declared dynamic" in str(w.message) for w in said), [str(w.message) for w in said]
