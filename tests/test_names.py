"""Input, output and graph names: from parameters and pytree paths, valid, unique, in order."""

from __future__ import annotations

import keyword

import onnx
import pytest
import torch

import clika_runtime as cr
from clika_runtime import CaptureError


def test_input_names_follow_parameters_and_pytree_paths():
    def fn(batch, *rest, scale_by=None):
        return batch["input_ids"] * batch["attention-mask"] + sum(rest) + scale_by[0]

    f = cr.compile(fn)
    batch = {"input_ids": torch.ones(2), "attention-mask": torch.ones(2)}
    f(batch, torch.ones(2), torch.ones(2), scale_by=[torch.ones(2)])
    assert f.input_names == ["batch_input_ids", "batch_attention_mask", "rest_0", "rest_1", "scale_by_0"]
    assert all(n.isidentifier() and not keyword.iskeyword(n) for n in f.input_names)
    graph = f.take_graph()
    assert graph.input_names == f.input_names


def test_clashing_paths_get_unique_names():
    f = cr.compile(lambda a, b: a["x_y"] + a["x"]["y"] + b)
    f({"x_y": torch.ones(1), "x": {"y": torch.ones(1)}}, torch.ones(1))
    assert f.input_names == ["a_x_y", "a_x_y_2", "b"]


def test_default_output_names_come_from_keys_and_positions():
    f = cr.compile(lambda x: {"logits": x + 1, "hidden": (x, x * 2)})
    f(torch.ones(2))
    assert f.take_graph().output_names == ["logits", "hidden_0", "hidden_1"]
    g = cr.compile(lambda x: (x + 1, x - 1))
    g(torch.ones(2))
    assert g.take_graph().output_names == ["out_0", "out_1"]


def test_output_names_and_graph_name_name_the_graph():
    f = cr.compile(lambda x: (x + 1, x.shape[0]), output_names=["plus_one", "rows"], graph_name="my_graph",
                   dynamic=True)
    f(torch.ones(2, 3))
    graph = f.take_graph()
    assert graph.output_names == ["plus_one", "rows"]
    assert graph.model_proto.graph.name == "my_graph"
    onnx.checker.check_model(graph.model_proto, full_check=True)


def test_wrong_number_of_output_names_is_a_clear_error():
    f = cr.compile(lambda x: (x + 1, x - 1), output_names=["only_one"], fullgraph=True)
    with pytest.raises(CaptureError, match=r"output_names: expected 2 names .*\['out_0', 'out_1'\].*got 1"):
        f(torch.ones(2))


def test_trap_output_names_given_twice_are_refused_not_renamed():
    # ["a", "a"] became "a" and "a_2" in the graph, silently (found by a trial).
    with pytest.raises(ValueError, match=r"output_names: 'a' given twice: each graph output needs a name of its own"):
        cr.compile(lambda x: (x * 2, x + 1), output_names=["a", "a"])
    with pytest.raises(TypeError, match=r"output_names: expected a list of names, got the str 'out' \(write \['out'\]\)"):
        cr.compile(lambda x: x * 2, output_names="out")
    with pytest.raises(TypeError, match=r"output_names\[1\]: expected a non-empty str, got 3"):
        cr.compile(lambda x: (x * 2, x + 1), output_names=["a", 3])


def test_trap_an_output_keyed_like_an_input_is_named_apart():
    # {"x": x + 1} named the output "x" like the input: onnxruntime refused the graph ("Duplicate
    # definition of name (x)") and the key served eagerly for good.
    f = cr.compile(lambda x: {"x": x + 1})
    x = torch.randn(3)
    f(x)
    out = f(x)
    assert f.state is cr.CompiledFunction.State.Compiled and f.captures[0].hits == 1, f.fallback_reason
    torch.testing.assert_close(out["x"], x + 1)
    assert f.take_graph().output_names == ["x_out"]
