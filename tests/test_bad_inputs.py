"""Bad inputs are the caller's, not the graph's: a served model that gets an id past the end
raises torch's error and keeps serving, without re-exporting or spending the budget."""

from __future__ import annotations

import pytest
import torch

import clika_runtime as cr
from conftest import Counted


def test_out_of_range_ids_raise_and_the_graph_serves_on():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)).eval()
    target = Counted(model)
    f = cr.compile(target)
    good = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        f(good)
        f(good)
        for _ in range(cr.config.recapture_limit + 2):  # more bad requests than the budget holds
            with pytest.raises(IndexError):
                f(torch.tensor([[1, 12, 3]]))
            calls = target.calls
            torch.testing.assert_close(f(good), model(good))
            assert target.calls == calls  # served by the graph: no re-export
    assert f.state is cr.CompiledFunction.State.Compiled and f.recapture_count == 0
