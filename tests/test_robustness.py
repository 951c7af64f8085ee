"""Nothing lost: any failure while capturing leaves the caller with the eager result (or a
``CaptureError`` under ``fullgraph=True``); every private API we use has a working public fallback;
graphs handed out are the caller's to change."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import optree
import pytest
import torch
from conftest import current

import clika_runtime as cr
import exporters.graph_edits
import serving
from clika_runtime import CaptureError
from clika_runtime.capture import capture
from clika_runtime.state import snapshot
from clika_runtime.trees import pytrees as trees

State = cr.CompiledFunction.State


def _boom(*args, **kwargs):
    raise KeyError("an unexpected failure inside the library")


@pytest.mark.parametrize("where", [(exporters.graph_edits, "name_dims"), (capture.serving, "TorchRunner"),
                                   (capture.serving, "open_session"), (capture, "bake")],
                         ids=["graph_edits", "runner", "session", "weights"])
def test_an_unexpected_failure_while_capturing_returns_the_eager_result(where, monkeypatch):
    module, name = where
    monkeypatch.setattr(module, name, _boom)
    f = cr.compile(lambda x: x * 3)
    with pytest.warns(UserWarning, match="capture failed: .*an unexpected failure inside the library"):
        torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 3.0))
    assert f.state is State.Fallback and "an unexpected failure" in f.fallback_reason
    g = cr.compile(lambda x: x * 3, fullgraph=True)
    with pytest.raises(CaptureError, match="an unexpected failure inside the library"):
        g(torch.ones(2))


def test_without_torch_onnx_internals_the_public_export_is_used(monkeypatch):
    from exporters import dynamo

    monkeypatch.setattr(dynamo, "_exporter_with_registry", lambda: None)
    f = cr.compile(lambda x: x.relu() + 1)
    x = torch.randn(3)
    f(x)
    torch.testing.assert_close(f(x), x.relu() + 1)
    assert f.state is State.Compiled


def test_without_the_private_session_run_the_public_run_serves(monkeypatch):
    monkeypatch.setattr(serving.runners, "_raw_run", lambda session: session.run)
    f = cr.compile(lambda x: x.repeat(64, 1))  # large outputs: the numpy path, which uses the raw run
    x = torch.randn(300, 4)
    f(x)
    assert current(f).parts.runner.path == "numpy"
    torch.testing.assert_close(f(x), x.repeat(64, 1))


def test_dicts_keep_insertion_order_without_optrees_private_switch(monkeypatch):
    monkeypatch.setattr(trees, "_private_setter", lambda: None)  # an optree that moved its private switch
    trees.keep_insertion_order("clika_runtime_test_fallback")
    leaves, _ = optree.tree_flatten({"b": 1, "a": 2}, namespace="clika_runtime_test_fallback")
    assert leaves == [1, 2]


def test_a_taken_graph_is_the_callers_to_change():
    f = cr.compile(lambda x: x + 1)
    f(torch.ones(2))
    kept = current(f)
    for graph in f.graphs() + [f.take_graph()]:
        del graph.model_proto.graph.node[:]  # the caller edits its copy
        graph.model_proto.graph.name = "edited"
    again = kept.graph().model_proto  # what the capture holds is unchanged
    assert again.graph.name != "edited" and len(again.graph.node) > 0


def test_graphs_hands_out_every_capture_without_changing_what_is_served():
    f = cr.compile(lambda x, mode: x + 1 if mode == "a" else x - 1)
    x = torch.ones(2)
    f(x, "a")
    f(x, "b")
    graphs = f.graphs()
    assert len(graphs) == len(f.captures) == 2 and f.state is State.Compiled
    assert [c.key for c in f.captures] == ["x: float32 on cpu, mode='a'", "x: float32 on cpu, mode='b'"]
    torch.testing.assert_close(f(x, "b"), x - 1)
    assert f.recapture_count == 1


def test_autocast_is_seen_without_torchs_private_check(monkeypatch):
    monkeypatch.delattr(torch._C, "_is_any_autocast_enabled")
    check = snapshot._autocast_check()
    assert not check()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert check()


_CTRL_C_IN_FIRST_EXPORT = """
import sys, torch, clika_runtime as cr
cr.config.cache_dir = None
assert "torch._dynamo" not in sys.modules


class Interrupter:  # Ctrl-C as the first export imports torch._dynamo (a real SIGINT there does the same)
    fired = False

    def find_spec(self, name, path=None, target=None):
        if not Interrupter.fired and name == "fx2trt_oss":  # looked for as torch._dynamo.trace_rules loads
            Interrupter.fired = True
            raise KeyboardInterrupt
        return None


sys.meta_path.insert(0, Interrupter())
f = cr.compile(torch.nn.Linear(8, 4).eval())
try:
    with torch.inference_mode():
        f(torch.randn(3, 8))
    print("returned", f.state, f.fallback_reason)
except KeyboardInterrupt:
    print("interrupted", Interrupter.fired)
"""


def test_trap_a_ctrl_c_in_the_first_export_reaches_the_caller():
    # torch's exporter catches `torch._dynamo.exc.UserError` while torch._dynamo is half
    # imported: the AttributeError that raised replaced the KeyboardInterrupt, which became a
    # failed capture, and the key served eagerly for good with a reason about torch._dynamo (a trial).
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", _CTRL_C_IN_FIRST_EXPORT], capture_output=True, text=True,
                          timeout=300, env=env)
    # (torch._dynamo stays half imported in that process, as after any import a Ctrl-C cut short.)
    assert done.stdout.split() == ["interrupted", "True"], (done.stdout, done.stderr[-2000:])
