"""What users read: each message names the cause and the fix in one sentence, once; the CLI turns
unusable input into one line and exit 2, a failing graph into exit 1."""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest
import torch

import clika_runtime as cr
from clika_runtime import CaptureError
from clika_runtime.cli import main as cli
from clika_runtime.validation import save_reference


class _Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.linear(x))


def test_a_training_mode_module_that_disagrees_is_told_to_call_eval():
    f = cr.compile(_Dropped())  # left in training mode
    with pytest.warns(UserWarning, match=r"draws random numbers \(aten\.native_dropout\.default\).*training-mode "
                                         r"module: call \.eval\(\)"):
        with torch.no_grad():
            out = f(torch.randn(4, 8))
    assert out.shape == (4, 8) and f.state is cr.CompiledFunction.State.Fallback
    assert "call .eval()" in f.fallback_reason


def test_a_data_dependent_branch_under_fullgraph_says_torch_cond_in_one_line():
    def branchy(x):
        return x * 2 if x.sum() > 0 else x - 1

    with pytest.raises(CaptureError) as info:
        cr.compile(branchy, fullgraph=True)(torch.ones(3))
    message = str(info.value)
    assert "torch.cond" in message and len(message.splitlines()) == 1 and len(message) < 600, message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no FX dump chained below it


def test_a_structure_change_names_the_argument_that_appeared():
    f = cr.compile(lambda x, mask=None: x if mask is None else x * mask)
    f(torch.ones(2))
    f(torch.ones(2), mask=torch.ones(2))
    assert f.recapture_reasons == ["new structure: 'mask' appeared"]


def test_a_float_that_varies_on_every_call_is_told_to_come_as_a_tensor(monkeypatch):
    monkeypatch.setattr(cr.config, "recapture_limit", 2)
    f = cr.compile(lambda x, sigma: x * sigma)
    with pytest.warns(UserWarning, match=r"re-capture limit \(2\) reached; last: static value changed: "
                                         r"'sigma' 0.3 -> 0.4; .* as a tensor \(torch.tensor\(value\)\)"):
        for sigma in (0.1, 0.2, 0.3, 0.4):
            f(torch.ones(2), sigma)
    assert f.state is cr.CompiledFunction.State.Fallback


def test_a_miss_is_explained_against_the_closest_key_not_the_last():
    f = cr.compile(lambda x, mode: x + 1 if mode == "a" else x - 1)
    f(torch.ones(2), "a")
    f(torch.ones(2, dtype=torch.float64), "a")  # a second key
    f(torch.ones(2), "b")  # closest to the first key: only the mode differs
    assert f.recapture_reasons[-1] == "static value changed: 'mode' 'a' -> 'b'"


def test_an_output_a_graph_cannot_return_names_its_type_and_the_fix():
    class Vocabulary:
        pass

    f = cr.compile(lambda x: (x + 1, Vocabulary()))
    with pytest.warns(UserWarning, match=r"output 1 is a Vocabulary, which a graph cannot return.*register the type"):
        out, vocabulary = f(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))  # the eager result, the object included
    assert isinstance(vocabulary, Vocabulary) and f.state is cr.CompiledFunction.State.Fallback


@pytest.mark.parametrize("target, where", [(lambda x: x * 2, "input 'x'"), (lambda x: torch.polar(x, x), "output 0")],
                         ids=["complex-input", "complex-output"])
def test_trap_complex_tensors_are_refused_with_the_fix_not_a_rank_riddle(target, where):
    # torch.onnx turns complex tensors into real pairs; the capture used to fail on "expected rank 2 [3, 2]".
    f = cr.compile(target, fullgraph=True)
    x = torch.randn(3, dtype=torch.complex64) if where.startswith("input") else torch.rand(3)
    with pytest.raises(CaptureError, match=rf"{where} is torch.complex64: pass torch.view_as_real"):
        f(x)


# ---------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    f = cr.compile(lambda x: x.softmax(-1))
    f(torch.randn(2, 4))
    f(torch.randn(3, 4))
    return f.take_graph().save(tmp_path_factory.mktemp("cli") / "softmax.onnx")


@pytest.mark.parametrize("command", ["inspect", "validate", "triton"])
def test_a_missing_file_is_one_line_and_exit_2_in_every_command(command, tmp_path, capsys):
    argv = [command, str(tmp_path / "missing.onnx")] + (["--repository", str(tmp_path)] if command == "triton" else [])
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no such file" in err and len(err.splitlines()) == 1, err


def test_a_reference_that_does_not_fit_the_graph_is_unusable_input(saved, tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    save_reference(bad, {"x": np.ones((2, 5), np.float32)}, {"output": np.ones((2, 5), np.float32)})
    assert cli(["validate", str(saved), "--reference", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --reference {bad}: input 'x' axis 1: expected size 4, got 5", err


def test_export_takes_examples_as_a_value_or_a_function(tmp_path, monkeypatch):
    (tmp_path / "examples_mod.py").write_text(textwrap.dedent("""
        import torch
        def model():
            return torch.nn.Linear(4, 2).eval()
        examples = (torch.randn(3, 4),)
        def make():
            return examples
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for inputs in ("examples_mod:examples", "examples_mod:make"):
        out = tmp_path / f"{inputs.split(':')[1]}.onnx"
        assert cli(["export", "examples_mod:model", "--inputs", inputs, "--out", str(out)]) == 0
        assert cr.ModelGraph.load(out).input_names == ["input"]


def test_each_warning_reaches_the_console_once():
    import subprocess
    import sys

    script = "import torch, clika_runtime as cr\ncr.compile(lambda x: x.add_(1))(torch.zeros(2))\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("serves eagerly until reset()") == 1, result.stderr


def test_warnings_point_at_the_users_line():
    f = cr.compile(lambda x: x.add_(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(torch.zeros(2))
    assert caught and caught[0].filename == __file__


def test_a_shipped_graph_names_an_argument_the_capture_left_to_its_default(tmp_path):
    class Scaled(torch.nn.Module):
        def forward(self, x, mask=None, scale: float = 1.0):
            return x * scale * mask

    f = cr.compile(Scaled())
    x, mask = torch.randn(2, 8), torch.ones(2, 1)
    f(x, mask=mask)
    served = cr.load(f.take_graph().save(tmp_path / "scaled.onnx"))
    with pytest.raises(cr.GraphInputError, match=r"unexpected \['scale'\].*captured from"):
        served(x, mask=mask, scale=1.0)
