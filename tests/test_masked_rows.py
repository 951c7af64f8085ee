"""``nn.MultiheadAttention`` over a batch row whose keys are all padding, and what verification
says when NaN meets a number.

torch's own paths disagree on such a row: the math path (``need_weights=True``, the default)
gives NaN in every mode, the fast path (``need_weights=False`` in eval mode without grad,
``torch._native_multi_head_attention``) gives NaN, and the SDPA path (``need_weights=False``
otherwise) gives zeros. torch.export never takes the fast path, so a graph follows the path it
traced: NaN with weights, SDPA's zeros without (README, "What differs from eager").
"""

from __future__ import annotations

import math

import pytest
import torch

import clika_runtime as cr
from clika_runtime.capture.verify import first_mismatch

BATCH, SEQ, WIDTH = 2, 4, 8


def _attention(need_weights: bool):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(WIDTH, 2, batch_first=True).eval()
    return lambda x, padding: mha(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]


def _padding(fully_padded_row: bool) -> torch.Tensor:
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[1, SEQ // 2:] = True  # a shorter sequence in row 1
    if fully_padded_row:
        padding[1] = True  # row 1 is filler: every key is padding
    return padding


def test_fully_padded_row_is_served_as_sdpa_zeros_where_the_fast_path_gives_nan():
    fn = _attention(need_weights=False)
    f = cr.compile(fn)
    x = torch.randn(BATCH, SEQ, WIDTH)
    with torch.no_grad():
        f(x, _padding(False))
        served = f(x, _padding(True))
        eager = fn(x, _padding(True))  # eval + no grad: torch's fast path
    assert len(f.captures) == 1  # served by the graph captured from the first call
    assert eager[1].isnan().all()
    assert torch.equal(served[1], torch.zeros(SEQ, WIDTH))
    torch.testing.assert_close(served[0], eager[0])
    with torch.enable_grad():  # the SDPA path torch takes with grad on agrees with the graph
        torch.testing.assert_close(served, fn(x, _padding(True)).detach())


def test_fully_padded_row_with_weights_is_nan_as_eager():
    fn = _attention(need_weights=True)
    f = cr.compile(fn)
    x = torch.randn(BATCH, SEQ, WIDTH)
    with torch.no_grad():
        f(x, _padding(False))
        served = f(x, _padding(True))
        eager = fn(x, _padding(True))
    assert len(f.captures) == 1
    assert served[1].isnan().all() and eager[1].isnan().all()
    torch.testing.assert_close(served[0], eager[0])


def test_refusal_says_eager_has_nan_where_the_graph_has_zeros():
    """The capturing call holds the padded row: the graph's zeros disagree with the fast path's
    NaN, and the message says so instead of "max abs difference inf"."""
    fn = _attention(need_weights=False)
    f = cr.compile(fn)
    with torch.no_grad(), pytest.warns(UserWarning, match=(
            r"output 'output': values differ: eager has NaN at 32 positions where the graph has numbers, "
            r"the first at \[1, 0, 0\]")):
        f(torch.randn(BATCH, SEQ, WIDTH), _padding(True))
    assert "inf" not in f.fallback_reason
    assert "max abs difference" not in f.fallback_reason


@pytest.mark.parametrize(("eager", "graph", "expected"), [
    ([1.0, 2.0], [1.0, 2.5], "values differ: max abs difference 0.5 (rtol"),
    ([1.0, 2.0], [math.nan, 2.0], "the graph has NaN at 1 position where eager has numbers, the first at [0] (rtol"),
    ([math.inf, 2.0], [1.0, 2.0], "infinities differ at 1 position, the first at [0] (rtol"),
    ([math.nan, 2.0, 3.0], [0.0, 2.5, 3.0],
     "eager has NaN at 1 position where the graph has numbers, the first at [0]; "
     "max abs difference 0.5 where both are finite (rtol"),
])
def test_mismatch_names_what_differs(eager, graph, expected):
    message = first_mismatch(["y"], [torch.tensor(eager)], [torch.tensor(graph)])
    assert message is not None and message.startswith("output 'y': ")
    assert expected in message


def test_nan_on_both_sides_agrees():
    assert first_mismatch(["y"], [torch.tensor([math.nan, 1.0])], [torch.tensor([math.nan, 1.0])]) is None


@pytest.mark.parametrize(("eager", "graph", "agrees"), [
    ([8.0, 0.01], [8.0, 0.01 + 2.5e-5], True),  # round-off of an output whose values run to 8
    ([1.0, 0.01], [1.0, 0.01 + 2.5e-5], False),  # the same difference in an output of unit size
    ([8.0, 0.01], [8.0, 0.02], False),  # a real difference at any size
    ([math.inf, 8.0, 0.01], [math.inf, 8.0, 0.01 + 2.5e-5], True),  # the size read where finite
])
def test_trap_the_absolute_tolerance_grows_with_the_outputs_size(eager, graph, agrees):
    """float32's round-off grows with the size of the values summed: a Whisper whose logits run
    to 8 was refused over 2.8e-5 (atol 1e-5) at a logit near 0, and served eagerly for good. The
    absolute tolerance is scaled by the output's largest finite magnitude, when above 1."""
    message = first_mismatch(["y"], [torch.tensor(eager)], [torch.tensor(graph)])
    assert (message is None) == agrees, message
