"""A NaN in the input comes out where torch lets it out: max and min reductions, max pooling and
argmax/argmin propagate it in torch; onnxruntime's kernels skip it, and a graph verified on clean
inputs served plausible numbers for a corrupt one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import clika_runtime as cr


class Pools(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.pool, self.fc = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.MaxPool2d(2), torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.pool(torch.relu(self.conv(x)))
        logits = self.fc(h.amax(dim=(2, 3)))
        values, where = h.max(1)
        return {"logits": logits, "class": logits.argmax(-1), "low": logits.argmin(-1), "max": values,
                "argmax": where, "min": h.min(), "amin": h.amin(1), "flat": h.flatten(1).argmax()}


@pytest.fixture(scope="module")
def served():
    model = Pools().eval()
    f = cr.compile(model)
    with torch.no_grad():
        f(torch.randn(2, 1, 8, 8))  # captured and verified on a clean input
    return model, f


@pytest.mark.parametrize("where", [(0, 0, 3, 3), (1, 0, 0, 7)])
def test_a_nan_in_the_input_comes_out_as_in_torch(served, where):
    model, f = served
    x = torch.randn(2, 1, 8, 8)
    x[where] = float("nan")
    with torch.no_grad():
        got, expected = f(x), model(x)
    assert f.state is cr.CompiledFunction.State.Compiled and f.captures[0].hits >= 1
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], equal_nan=True, msg=name)
    assert got["logits"][where[0]].isnan().all()


def test_clean_inputs_are_untouched(served):
    model, f = served
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        got, expected = f(x), model(x)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


@pytest.mark.parametrize("pool, shape", [
    (torch.nn.MaxPool2d(3, stride=2, padding=1), (1, 2, 9, 9)),
    (torch.nn.MaxPool2d(2, ceil_mode=True), (1, 2, 7, 7)),
    (torch.nn.MaxPool2d((2, 3), stride=(1, 2), dilation=2), (1, 2, 9, 9)),
    (torch.nn.MaxPool2d(2), (2, 6, 6)),  # one image without a batch axis
], ids=["padded", "ceil mode", "dilated", "unbatched"])
def test_every_max_pooling_window_holding_a_nan_is_nan(pool, shape):
    f = cr.compile(pool)
    f(torch.randn(shape))
    x = torch.randn(shape)
    x[..., 0, 0] = float("nan")
    x[..., -1, 4] = float("nan")
    got = f(x)
    assert f.state is cr.CompiledFunction.State.Compiled
    torch.testing.assert_close(got, pool(x), equal_nan=True)
    assert got.isnan().any()


class Infinities(torch.nn.Module):
    """A convolution that adds +inf and -inf (NaN, in torch as in onnxruntime), then max pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 2, bias=False)
        torch.nn.init.constant_(self.conv.weight, 0.5)
        self.pool = torch.nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(torch.relu(self.conv(x)))


def test_a_nan_made_inside_the_graph_is_pooled_as_in_torch():
    """The served graph pools with a bare MaxPool unless a pool's own input holds a NaN: the
    input here has none, the convolution makes one, and the window holding it is NaN as in torch."""
    model = Infinities().eval()
    f = cr.compile(model)
    with torch.no_grad():
        f(torch.randn(1, 1, 9, 9))
        x = torch.randn(1, 1, 9, 9)
        x[0, 0, 2, 2], x[0, 0, 2, 3] = float("inf"), float("-inf")
        assert not x.isnan().any()
        got, expected = f(x), model(x)
    assert f.captures[0].hits == 1  # the second call, served
    assert expected.isnan().any()
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_pools_run_bare_unless_a_nan_reaches_them(served):
    """The speed half of the guard: the graph's pools are MaxPool alone, the NaN windows in the
    branch that runs only for a pool input holding a NaN (``exporters/nan_guard.py``)."""
    _, f = served
    graph = f.take_graph().model_proto.graph
    ops = [node.op_type for node in graph.node]
    assert "MaxPool" in ops and "AveragePool" not in ops and "Where" not in ops[:ops.index("MaxPool") + 2]
    (guard,) = [node for node in graph.node if node.op_type == "If"]
    exact = next(a.g for a in guard.attribute if a.name == "then_branch")
    assert "AveragePool" in [node.op_type for node in exact.node]


class MaskedAttention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("boolean", [True, False], ids=["boolean mask", "float mask"])
def test_a_nan_through_masked_attention_comes_out_as_in_torch(boolean):
    """torchlib zeroed NaN after a boolean-masked softmax: a NaN query came out 0 served, NaN
    eager. A row the mask hides entirely is still zeros, as in torch."""
    model, f = MaskedAttention(), cr.compile(MaskedAttention())
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    mask[..., 2, :] = False  # query row 2 sees no key
    if not boolean:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    with torch.no_grad():
        f(q, k, v, mask)
        q[0, 0, 1, 3] = float("nan")
        got, expected = f(q, k, v, mask), model(q, k, v, mask)
    assert f.captures[0].hits == 1
    assert expected[0, 0, 1].isnan().all() and (expected[0, :, 2] == 0).all()
    torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.fixture(scope="module", params=[True, False], ids=["boolean mask", "float mask"])
def masked_attention(request):
    f = cr.compile(MaskedAttention())
    with torch.no_grad():
        f(*_masked_inputs(request.param))
    return f, request.param


def _masked_inputs(boolean: bool) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(1, 2, 4 + (i > 0), 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    mask[..., 2, :] = False  # query row 2 sees no key
    return q, k, v, mask if boolean else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["value", "key", "hidden query"])
def test_trap_a_nan_reaching_a_hidden_row_comes_out_as_in_torch(masked_attention, where, value):
    """torch's hidden row is its zero weights times the values: a NaN or inf value makes its column
    NaN, and a NaN key or hidden query makes the whole row NaN (the score is NaN before the mask
    hides it). The served graph zeroed the row whatever it held."""
    f, boolean = masked_attention
    q, k, v, mask = _masked_inputs(boolean)
    {"value": v[0, 1, 3], "key": k[0, 0, 1], "hidden query": q[0, 1, 2]}[where][5] = value
    q[0, 0, 2, 5] = 1.0  # an infinite key's score with the hidden row is +inf: +inf plus the mask's -inf is NaN
    with torch.no_grad():
        hits = f.captures[0].hits
        got, expected = f(q, k, v, mask), MaskedAttention()(q, k, v, mask)
    assert f.captures[0].hits == hits + 1
    assert expected[0, :, 2].isnan().any()
    torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("values", [("inf",), ("nan",), ("inf", "-inf"), ("-inf",)])
@pytest.mark.parametrize("size", [9, 10], ids=["windows apart", "windows overlapping"])
def test_trap_an_inf_or_nan_stays_in_its_adaptive_average_pooling_windows(values, size):
    # The translation averages as matrix products, whose zero weights turned one inf or NaN into
    # NaN across the whole output (a trial: 3x3 of NaN where torch has one inf and eight 1.0s).
    def pool(x):
        return F.adaptive_avg_pool2d(x, (3, 3))

    f = cr.compile(pool)
    x = torch.ones(1, 2, size, size)
    for i, value in enumerate(values):
        x[0, 0, 0, 3 * i] = float(value)  # the same window for 9, neighbouring windows sharing a column for 10
    x[0, 1, 4, 4] = float(values[-1])
    with torch.no_grad():
        f(torch.randn(1, 2, size, size))
        got = f(x)
    torch.testing.assert_close(got, pool(x), equal_nan=True)
    assert f.captures[0].hits == 1
    # The masks run only where a product is not finite: outside the guard, two MatMuls and no mask.
    ops = [node.op_type for node in f.take_graph().model_proto.graph.node]
    assert ops.count("MatMul") == 2 and "Where" not in ops and ops.count("If") == 1, ops
