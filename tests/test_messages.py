"""What users read: each message names the cause and the fix in one sentence, once; the CLI turns
unusable input into one line and exit 2, a failing graph into exit 1."""

from __future__ import annotations

import dataclasses
import os
import textwrap
import warnings

import numpy as np
import pytest
import torch

import clika_runtime as cr
from clika_runtime import CaptureError
from clika_runtime.cli import main as cli
from clika_runtime.shipped.validation import save_reference


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


def test_trap_a_list_passed_again_as_a_tuple_says_so():
    # The same leaves in another container read "the inputs were rearranged: 'xs_0', 'xs_1' -> 'xs_0', 'xs_1'".
    f = cr.compile(lambda xs: xs[0] + xs[1])
    f([torch.ones(2), torch.ones(2)])
    f((torch.ones(2), torch.ones(2)))
    assert f.recapture_reasons == ["new structure: a list became a tuple (holding 'xs_0', 'xs_1')"]


def test_trap_a_tensor_argument_left_out_is_named_not_its_neighbour():
    # mask went from a tensor to None; the reason blamed 'labels' (the static values, compared by
    # position, had shifted by one).
    f = cr.compile(lambda x, mask=None, labels=None, use_cache=None: x * 2 if mask is None else x * mask)
    f(torch.ones(2, 4), mask=torch.ones(2, 4), use_cache=True)
    f(torch.ones(2, 4), use_cache=True)
    assert f.recapture_reasons == ["input 'mask' changed: a float32 tensor -> None"]


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


@pytest.mark.parametrize("make, words", [
    (lambda: torch.eye(3).to_sparse(), "a sparse tensor"),
    (lambda: torch.eye(3).to_sparse_csr(), "a sparse tensor"),
    (lambda: torch.empty(3, 3, device="meta"), "on the meta device"),
], ids=["sparse-coo", "sparse-csr", "meta"])
def test_trap_a_tensor_a_graph_cannot_take_is_refused_in_words_not_as_our_bug(make, words):
    """Under inference_mode a sparse or meta input hit 'this is a bug in clika_runtime' (its bytes
    were compared to tell whether the call wrote it)."""
    target = lambda x: x * 2  # noqa: E731
    f = cr.compile(target)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = f(make())
    assert not any("bug in clika_runtime" in str(w.message) for w in said), [str(w.message) for w in said]
    assert out.device == target(make()).device
    assert any(words in why for why in f.eager_keys.values()), f.eager_keys


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


# ------------------------------------------------------------------- what a new user stumbles on


def test_dynamic_true_names_the_size_1_axis_it_left_static():
    # torch.export specialises sizes 0 and 1: a batch-1 example cannot make axis 0 dynamic.
    f = cr.compile(torch.nn.Linear(8, 4).eval(), dynamic=True)
    with torch.no_grad():
        f(torch.randn(1, 8))
    assert f.capture_notes == [
        "axis 0 of 'input' has size 1 in the example: torch.export specialises sizes 0 and 1, so it was captured "
        "static; capture with a size >= 2 on that axis to make it dynamic (or declare it: dynamic_axes, a named "
        "signature dim)"], f.capture_notes


def test_trap_a_size_1_graph_beside_a_dynamic_one_asks_nothing_of_the_user():
    """Captured dynamic at batch 2, then called at batch 1: the size-1 graph made beside the
    dynamic one noted "capture with a size >= 2 on that axis to make it dynamic", which the user
    had done (a new-user trial). Sizes 0 and 1 get a graph of their own by design: no note."""
    f = cr.compile(torch.nn.Linear(8, 4).eval(), dynamic=True)
    with torch.no_grad():
        f(torch.randn(2, 8))
        f(torch.randn(1, 8))
    assert len(f.captures) == 2 and f.capture_notes == [], f.capture_notes


def test_export_dynamic_says_which_axis_stayed_static_and_its_help_says_why(tmp_path, monkeypatch, capsys):
    (tmp_path / "batch1_mod.py").write_text(textwrap.dedent("""
        import torch
        def model():
            return torch.nn.Linear(4, 2).eval()
        examples = (torch.randn(1, 4),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "b1.onnx"
    assert cli(["export", "batch1_mod:model", "--inputs", "batch1_mod:examples", "--out", str(out), "--dynamic"]) == 0
    printed = capsys.readouterr().out
    assert "note: axis 0 of 'input' has size 1 in the example: torch.export specialises sizes 0 and 1" in printed
    with pytest.raises(SystemExit):
        cli(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "every axis dynamic from the first capture, except axes of size 0 or 1 in the example" in help_text


def test_a_missing_reference_is_one_line_and_exit_2(saved, tmp_path, capsys):
    missing = tmp_path / "missing.npz"
    assert cli(["validate", str(saved), "--reference", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"error: --reference {missing}: no such file" and not captured.out, captured


def test_a_text_file_as_reference_says_what_was_expected_and_what_it_got(saved, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("the reference outputs are in the other folder\n")
    assert cli(["validate", str(saved), "--reference", str(notes)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --reference {notes}: expected an .npz of arrays (numpy.savez), got a text file", err


def test_a_single_npy_array_as_reference_is_told_to_name_its_arrays(saved, tmp_path, capsys):
    array = tmp_path / "x.npy"
    np.save(array, np.ones((2, 4), np.float32))
    assert cli(["validate", str(saved), "--reference", str(array)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --reference {array}: expected an .npz of arrays (numpy.savez), got one unnamed array "
                   f"(an .npy): save the inputs and outputs by name with numpy.savez"), err


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_a_file_that_is_not_a_graph_is_exit_2_in_inspect_and_validate(command, tmp_path, capsys):
    # docs/CLI.md: an unreadable file is unusable input (2), not a graph failing a check (1).
    text = tmp_path / "notonnx.onnx"
    text.write_text("not an onnx model\n")
    assert cli([command, str(text)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"error: {text}: not a readable ONNX model") and len(err.splitlines()) == 1, err
    assert not captured.out


def test_export_with_examples_that_break_the_model_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_mod.py").write_text(textwrap.dedent("""
        import torch
        def model():
            return torch.nn.Linear(4, 2).eval()
        examples = (torch.randn(3, 5),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["export", "broken_mod:model", "--inputs", "broken_mod:examples", "--out", str(tmp_path / "m.onnx")]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: broken_mod:model raised RuntimeError on the examples from broken_mod:examples (shapes [3, 5]): "
                   "mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2); give examples the model takes"), err


def test_inspect_of_a_folder_says_it_is_a_folder_and_what_to_pass(saved, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["inspect", str(empty)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {empty}: a folder, not a graph file: give an .onnx file"
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "softmax.onnx").write_bytes(saved.read_bytes())
    assert cli(["inspect", str(holder)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {holder}: a folder, not a graph file: it holds one graph, pass {holder / 'softmax.onnx'}")


def test_inspect_and_validate_of_a_triton_repository_say_what_to_pass(saved, tmp_path, capsys):
    repository = tmp_path / "repository"
    model = cr.ModelGraph.load(saved).to_triton(repository, "softmax")
    assert cli(["inspect", str(model)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {model}: a folder, not a graph file: it is a Triton model folder: pass its model file, "
        f"{model / '1' / 'model.onnx'} (validate takes the folder itself)")
    assert cli(["inspect", str(repository)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {repository}: a folder, not a graph file: it is a Triton model repository: pass a model's file, "
        f"e.g. {model / '1' / 'model.onnx'}")
    assert cli(["validate", str(repository)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {repository}: a folder without config.pbtxt: it is a Triton model repository: validate one "
        f"model folder, e.g. {model}")


def _one_error_line(capsys, starts: str) -> str:
    """The only line the command printed (on stderr, nothing on stdout), checked to start with ``starts``."""
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(starts) and len(err.splitlines()) == 1 and not captured.out, captured
    return err


def test_trap_triton_into_a_repository_it_cannot_make_is_one_line_and_exit_2(saved, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    assert cli(["triton", str(saved), "--repository", str(afile)]) == 2
    assert _one_error_line(capsys, "") == f"error: --repository {afile}: expected a folder, found a regular file"
    assert cli(["triton", str(saved), "--repository", str(afile / "repo")]) == 2
    assert _one_error_line(capsys, "") == (f"error: --repository {afile / 'repo'}: expected a folder at {afile}, "
                                           f"found a regular file")
    for special in ("/proc/nope", "/sys/nope"):  # folders the kernel lets no one write in, root included
        assert cli(["triton", str(saved), "--repository", special]) == 2
        assert "expected a folder it can write in, got" in _one_error_line(capsys, f"error: --repository {special}: ")
    assert afile.read_text() == "not a folder\n"


@pytest.fixture()
def export_mod(tmp_path, monkeypatch):
    (tmp_path / "export_mod.py").write_text(textwrap.dedent("""
        import torch
        def model():
            return torch.nn.Linear(4, 2).eval()
        def not_callable():
            return 42
        examples = (torch.randn(3, 4),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_trap_export_of_a_factory_that_returns_no_callable_is_one_line_and_exit_2(export_mod, capsys):
    argv = ["export", "export_mod:not_callable", "--inputs", "export_mod:examples", "--out", str(export_mod / "m.onnx")]
    assert cli(argv) == 2
    assert _one_error_line(capsys, "") == ("error: export_mod:not_callable: expected it to return a callable "
                                           "(a model or function), got int")


def test_trap_export_to_an_out_it_cannot_write_is_one_line_and_exit_2(export_mod, capsys):
    afile = export_mod / "afile"
    afile.write_text("not a folder\n")
    expected = {str(afile / "m.onnx"): f"expected a folder at {afile}, found a regular file",
                f"{export_mod}/": "expected a file path, got one ending in '/'",
                str(export_mod): "expected a file path, found a folder"}
    for out, why in expected.items():
        assert cli(["export", "export_mod:model", "--inputs", "export_mod:examples", "--out", out]) == 2
        assert _one_error_line(capsys, "") == f"error: --out {out}: {why}"
    assert cli(["export", "export_mod:model", "--inputs", "export_mod:examples", "--out", "/sys/m.onnx"]) == 2
    assert "expected a folder it can write in, got" in _one_error_line(capsys, "error: --out /sys/m.onnx: ")


@pytest.mark.parametrize("sizes", ["-1", "1,-3"])
def test_trap_validate_with_a_negative_dim_size_is_a_usage_error(saved, sizes, capsys):
    assert cli(["validate", str(saved), "--dims", f"x_dim0={sizes}"]) == 2
    assert _one_error_line(capsys, "") == f"error: --dims 'x_dim0={sizes}': expected sizes >= 0, got {sizes.split(',')[-1]}"


def test_trap_inspect_of_a_device_says_it_is_not_a_regular_file(capsys):
    assert cli(["inspect", os.devnull]) == 2
    assert _one_error_line(capsys, "") == f"error: {os.devnull}: not a regular file (a character device), not an ONNX graph"


def test_trap_validate_of_a_graph_whose_external_data_is_missing_is_one_line_and_exit_2(tmp_path, capsys):
    f = cr.compile(torch.nn.Linear(4, 2).eval())
    with torch.no_grad():
        f(torch.randn(3, 4))
    path = f.take_graph().save(tmp_path / "linear.onnx", external_data=True)
    (data,) = [p for p in tmp_path.iterdir() if p.suffix == ".data"]
    data.unlink()
    assert cli(["validate", str(path)]) == 2
    assert _one_error_line(capsys, "") == (f"error: {path}: its external data file '{data.name}' is missing from "
                                           f"{tmp_path}: copy it beside the graph file")


def _data_dependent_slice(x):
    return x[:int((x > 0).sum())]


def test_a_data_dependent_capture_keeps_torchs_graph_dumps_off_the_console():
    import subprocess
    import sys

    script = ("import torch, clika_runtime as cr\n"
              "f = cr.compile(lambda x: x[:int((x > 0).sum())]); f(torch.randn(8)); f(torch.randn(8))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "serves eagerly until reset()" in lines[0], result.stderr  # our warning, nothing else


def test_a_data_dependent_capture_logs_few_lines_and_restores_torchs_log_levels(caplog):
    import logging

    watched = ("torch", "torch.fx", "torch.__trace", "torch.fx.experimental.symbolic_shapes")
    levels = {name: logging.getLogger(name).level for name in watched}
    caplog.set_level(logging.DEBUG)
    f = cr.compile(_data_dependent_slice)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(torch.randn(8))
    assert f.state is cr.CompiledFunction.State.Fallback
    foreign = [r.name for r in caplog.records if not r.name.startswith("clika_runtime")]
    ours = [caplog.handler.format(r) for r in caplog.records if r.name.startswith("clika_runtime")]
    assert not foreign, sorted(set(foreign))
    assert len(ours) <= 3 and sum(len(text.splitlines()) for text in ours) <= 8, ours
    assert {name: logging.getLogger(name).level for name in watched} == levels


def test_a_size_read_from_a_tensor_is_not_called_a_branch():
    with pytest.raises(CaptureError) as info:
        cr.compile(_data_dependent_slice, fullgraph=True)(torch.randn(8))
    message = str(info.value)
    assert "branches" not in message and "torch.cond" not in message, message
    assert "a size read from a tensor value" in message and "torch._check(" in message and "mask" in message, message


def test_the_size_fix_the_hint_gives_is_served():
    def bounded(x):  # the hint's fix: read the size with .item() and bound it with torch._check
        n = (x > 0).sum().item()
        torch._check(n >= 0)
        torch._check(n <= x.shape[0])
        return x[:n]

    f = cr.compile(bounded, fullgraph=True)
    for _ in range(3):
        x = torch.randn(8)
        torch.testing.assert_close(f(x), bounded(x))
    assert f.state is cr.CompiledFunction.State.Compiled and len(f.captures) == 1 and f.captures[0].hits >= 2


class _TiedMaxNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4, max_norm=1.0)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie them

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_embedding_max_norm_is_told_it_writes_its_weights_in_place():
    with pytest.raises(CaptureError) as info:
        with torch.no_grad():
            cr.compile(_TiedMaxNorm().eval(), fullgraph=True)(torch.tensor([[1, 2, 3]]))
    message = str(info.value)
    assert "writes a weight in place" in message and "nn.Embedding(max_norm=...)" in message, message
    assert "renormalises the rows it looks up in place on every forward" in message, message
    assert "max_norm = None" in message and "torch.renorm" in message, message


def test_the_max_norm_fix_the_hint_gives_is_served_and_matches_max_norm():
    model, fixed = _TiedMaxNorm().eval(), _TiedMaxNorm().eval()
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():  # the hint's fix: renormalise once, then max_norm=None
        model.embed(torch.arange(10))  # max_norm has renormalised every row once: what the fix does up front
        fixed.embed.weight.copy_(torch.renorm(fixed.embed.weight, 2, 0, fixed.embed.max_norm))
        fixed.embed.max_norm = None
        f = cr.compile(fixed, fullgraph=True)
        ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
        torch.testing.assert_close(f(ids), model(ids))
    assert f.state is cr.CompiledFunction.State.Compiled


@dataclasses.dataclass
class _Scale:
    scale: float = 2.0
    names: tuple = ("a",)


def test_trap_static_values_are_written_as_the_values_they_are_not_as_key_tuples():
    # A trial read "s=(<class 'float'>, 1.0, 1.0)" for np.float32(1.0), "s=('nan',)" for NaN and
    # "Cfg(('scale', (<class 'float'>, 2.0, 1.0)),)" for a dataclass in keys and reasons.
    f = cr.compile(lambda x, s: x * (s.scale if isinstance(s, _Scale) else s))
    x = torch.ones(2)
    config = _Scale()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in (float("nan"), np.float32(1.5), np.int64(2), config, {"k": 1.0}):
            try:
                f(x, s)
            except TypeError:  # the dict: multiplied, it raises as in eager
                pass
        config.scale = 3.0
        f(x, config)
    words = [c.key for c in f.captures] + f.recapture_reasons
    text = "\n".join(words)
    assert "class '" not in text and "('nan',)" not in text and "snapshot" not in text, text
    assert "s=nan" in text and "np.float32(1.5)" in text and "np.int64(2)" in text, text
    assert "_Scale(scale=2.0, names=('a',)) -> _Scale(scale=3.0, names=('a',))" in text, text
