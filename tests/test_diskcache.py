"""The on-disk capture cache: later processes find graphs earlier ones made, and nothing else
(changed weights, code, statics, versions miss); broken entries are ignored; writers race safely."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import stat
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import clika_runtime as cr
from clika_runtime.cache import diskcache, fingerprint
from clika_runtime.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys, torch, clika_runtime as cr
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).eval()
    if "--other-weights" in sys.argv:
        with torch.no_grad():
            model[0].weight.mul_(2)
    f = cr.compile(model)
    with torch.no_grad():
        for rows in map(int, [a for a in sys.argv[1:] if a.isdigit()]):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(f(x), model(x))
    print([sorted(c.phases) for c in f.captures], f.recapture_count)
""")


def _run(cache: Path, *args: str, root: Path = ROOT) -> str:
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": str(cache), "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env,
                            cwd=root)  # -c puts the working directory first on the path
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
def test_a_later_process_finds_the_graph_and_what_drift_taught(tmp_path):
    assert "'export'" in _run(tmp_path, "2", "5")  # first process: exports, drift makes axis 0 dynamic
    second = _run(tmp_path, "3", "7")  # a new process, first call at another size
    assert "'export'" not in second and second.endswith(" 0"), second  # found on disk, no re-capture
    assert "'export'" in _run(tmp_path, "3", "--other-weights")  # other weights: a miss


@pytest.mark.slow
def test_trap_a_graph_cached_by_other_code_of_the_same_version_is_not_served(tmp_path):
    """A graph made by the library's own code, as it was: a fixed translation kept serving its
    old graph from the cache after a `git pull` (the version string had not moved)."""
    import shutil

    for package in ("clika_runtime", "exporters", "serving"):
        shutil.copytree(ROOT / package, tmp_path / "lib" / package, ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    assert "'export'" in _run(cache, "2", root=tmp_path / "lib")
    assert "'export'" not in _run(cache, "2", root=tmp_path / "lib")  # the same code: found on disk
    with open(tmp_path / "lib" / "exporters" / "translations.py", "a") as source:
        source.write("\n# edited\n")
    assert "'export'" in _run(cache, "2", root=tmp_path / "lib")


@pytest.mark.slow
def test_two_processes_writing_one_key_both_end_with_a_valid_entry(tmp_path):
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen([sys.executable, "-c", SCRIPT, "4"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    cache = diskcache.DiskCache(tmp_path, 2**30)
    assert len(cache.entries()) == 1 and "'export'" not in _run(tmp_path, "4")


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).eval()


def _capture(model, x, **options):
    f = cr.compile(model, **options)
    with torch.no_grad():
        f(x)
    return f


def _exported(f) -> bool:
    return all("export" in c.phases for c in f.captures)


def test_a_second_function_of_the_same_model_finds_the_graph():
    model, x = _model(), torch.randn(2, 4)
    assert _exported(_capture(model, x))
    again = _capture(model, x)
    assert not _exported(again) and again.state is cr.CompiledFunction.State.Compiled
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def _clamp_to(limit):
    return lambda t: torch.clamp(t, max=limit)


def _holding(limit):
    class Holder(torch.nn.Module):
        LIMIT = limit

        def __init__(self, fn=None):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x) if self.fn is not None else torch.clamp(x, max=type(self).LIMIT)

    return Holder


def _bert(attention):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 vocab_size=50)).eval()
    model.set_attn_implementation(attention)
    return model


@pytest.mark.parametrize("held", ["partial", "closure", "class attribute", "builtin", "attention implementation"])
def test_trap_what_a_module_holds_is_in_the_key(held):
    """A function, partial or class attribute the module holds decides what its graph computes:
    a later process with another value was served the old graph, whenever its first call could
    not tell them apart (a clamp's limit above every value of that call)."""
    import functools

    x = torch.zeros(2, 3)
    if held == "attention implementation":  # differs from sdpa on a row of padding only
        ids = torch.randint(5, 50, (2, 6))
        first = cr.compile(_bert("sdpa"))
        with torch.no_grad():
            first(input_ids=ids, attention_mask=torch.ones_like(ids))
        assert _exported(first)
        again = cr.compile(_bert("eager"))
        with torch.no_grad():
            again(input_ids=ids, attention_mask=torch.ones_like(ids))
        assert _exported(again)
        return
    make = {
        "partial": lambda v: _holding(None)(functools.partial(torch.clamp, max=v)),
        "closure": lambda v: _holding(None)(_clamp_to(v)),
        "class attribute": lambda v: _holding(v)(),
        "builtin": lambda v: _holding(None)(torch.relu if v == 0.5 else torch.abs),  # alike at 0
    }[held]
    assert _exported(_capture(make(0.5), x))
    assert not _exported(_capture(make(0.5), x))  # the same: found
    assert _exported(_capture(make(2.0), x))


@pytest.mark.parametrize("change", ["weights", "code", "static", "versions"])
def test_what_decides_the_graph_is_in_the_key(change, monkeypatch):
    model, x = _model(), torch.randn(2, 4)
    _capture(model, x)
    if change == "weights":
        other = _model()
        with torch.no_grad():
            other.weight.add_(1)
        assert _exported(_capture(other, x))
    elif change == "code":
        assert _exported(_capture(lambda t: model(t) * 2, x))
    elif change == "static":
        f = cr.compile(lambda t, k: model(t) * k)
        f(x, 2)
        g = cr.compile(lambda t, k: model(t) * k)
        with torch.no_grad():
            g(x, 3)
        assert _exported(g)
    else:
        monkeypatch.setattr(fingerprint, "_versions", lambda: "torch 99")
        assert _exported(_capture(model, x))


EDITED = textwrap.dedent("""
    import torch

    CLAMP = {clamp}

    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(4, 4)

        def act(self, x):
            return x.clamp(min={floor})

        def forward(self, x):
            return self.act(self.linear(x)).clamp(max=CLAMP)
""")


def _edited(folder: Path, clamp: float, floor: float, stamp: int) -> torch.nn.Module:
    """The model of a file as it is after an edit (a fresh import, as a later process makes)."""
    path = folder / "edited_model.py"
    path.write_text(EDITED.format(clamp=clamp, floor=floor))
    os.utime(path, ns=(stamp, stamp))  # edits within one clock tick still differ in time
    spec = importlib.util.spec_from_file_location("edited_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Clamped().eval()


@pytest.mark.parametrize("edit", [(0.5, -1.0), (1.0, -0.5)], ids=["a global constant", "a helper method"])
def test_an_edit_to_the_models_file_is_a_new_graph(tmp_path, edit):
    # forward's bytecode stays the same: a small first call (inside every clamp) would verify a
    # graph cached before the edit, and later calls would be served the old clamps.
    warm, wide = torch.full((2, 4), 0.01), torch.linspace(-4, 4, 8).reshape(2, 4)
    _capture(_edited(tmp_path, 1.0, -1.0, 10**18), warm)
    model = _edited(tmp_path, *edit, 2 * 10**18)
    f = _capture(model, warm)
    assert _exported(f)
    with torch.no_grad():
        torch.testing.assert_close(f(wide), model(wide))


_LIMIT = 1.0


def _limited(x):
    return x.clamp(max=_LIMIT)


def test_a_plain_global_value_the_code_reads_is_in_the_key(monkeypatch):
    # Code typed into a notebook has no file to digest: the values it names stand in.
    _capture(_limited, torch.zeros(2))
    monkeypatch.setattr(sys.modules[__name__], "_LIMIT", 0.5)
    f = _capture(_limited, torch.zeros(2))  # zeros: under either limit, the old graph would verify
    assert _exported(f)
    torch.testing.assert_close(f(torch.full((2,), 3.0)), torch.full((2,), 0.5))


def _limited_at(limit):
    def limited(x):
        return x.clamp(max=limit)

    return limited


def test_a_plain_value_the_function_closes_over_is_in_the_key():
    # One file, a factory called with the run's setting: the code is the same in both runs.
    _capture(_limited_at(1.0), torch.zeros(2))
    f = _capture(_limited_at(0.5), torch.zeros(2))
    assert _exported(f)
    torch.testing.assert_close(f(torch.full((2,), 3.0)), torch.full((2,), 0.5))


def _pooled(ceil):
    return lambda x, c=ceil: torch.nn.functional.max_pool1d(x, 2, ceil_mode=c)


def test_a_default_value_of_the_function_is_in_the_key():
    # Even sizes pool alike either way: the old graph would verify, then serve odd sizes wrong.
    _capture(_pooled(True), torch.randn(1, 1, 10))
    f = _capture(_pooled(False), torch.randn(1, 1, 10))
    assert _exported(f)


class _Table(torch.nn.Module):
    """Reads a plain tensor attribute: the exporter bakes it like a buffer."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.table = torch.zeros(10)
        self.table[5:] = fill

    def forward(self, idx):
        return self.table[idx] + 1


def test_a_plain_tensor_attribute_is_in_the_key():
    first = cr.compile(_Table(1.0))
    first(torch.tensor([0, 1, 2]))
    other = _Table(7.0)
    f = cr.compile(other)
    f(torch.tensor([0, 1, 2]))  # rows both tables share: a graph found in the cache would verify
    assert _exported(f)
    torch.testing.assert_close(f(torch.tensor([5, 6, 7])), torch.full((3,), 8.0))


def test_reset_after_a_write_through_data_hashes_the_weights_again():
    """A write through ``.data`` moves neither the tensor's version nor its memory: the README
    says to call reset(), after which the disk cache must not hand back the old graph."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(10, 3).eval()
    f = _capture(table, torch.tensor([1, 2, 3]))
    table.weight.data[7] = 100.0
    f.reset()
    with torch.no_grad():
        f(torch.tensor([1, 2, 3]))  # rows the write left alone: an old graph would verify
        assert _exported(f)
        torch.testing.assert_close(f(torch.tensor([7, 7, 1])), table(torch.tensor([7, 7, 1])))


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_a_broken_entry_is_ignored_and_replaced(damage):
    model, x = _model(), torch.randn(2, 4)
    _capture(model, x)
    (entry,) = (Path(cr.config.cache_path()) / "entries").iterdir()
    if damage == "corrupt":
        (entry / diskcache.ENTRY).write_text("{not json")
    elif damage == "truncated":
        data = (entry / "model.onnx").read_bytes()
        (entry / "model.onnx").write_bytes(data[: len(data) // 3])
    else:
        (entry / "model.onnx").unlink()
    again = _capture(model, x)
    assert _exported(again) and again.state is cr.CompiledFunction.State.Compiled
    assert not _exported(_capture(model, x))  # replaced by a sound entry


def test_an_entry_that_disagrees_with_eager_is_not_served():
    model, x = _model(), torch.randn(2, 4)
    _capture(model, x)
    # The same key, other weights in the file: verification against eager refuses it.
    (entry,) = (Path(cr.config.cache_path()) / "entries").iterdir()
    other = torch.nn.Linear(4, 3).eval()
    f = cr.compile(other)
    with torch.no_grad():
        f(x)
    (other_entry,) = [e for e in (Path(cr.config.cache_path()) / "entries").iterdir() if e != entry]
    for path in other_entry.iterdir():
        if path.name != diskcache.ENTRY:
            (entry / path.name).write_bytes(path.read_bytes())  # same sizes, other weights
    again = _capture(model, x)
    assert _exported(again)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def test_cache_off_leaves_no_files(tmp_path):
    cr.config.cache_dir = None
    _capture(_model(), torch.randn(2, 4))
    assert cr.config.cache_path() is None and not list(tmp_path.iterdir())


def test_an_unwritable_cache_warns_once_and_serves(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    cr.config.cache_dir = blocked / "cache"
    with pytest.warns(UserWarning, match="cannot be used"):
        f = _capture(_model(), torch.randn(2, 4))
    assert f.state is cr.CompiledFunction.State.Compiled


@pytest.mark.parametrize("damage", ["removed", "work-is-a-file"])
def test_trap_a_cache_folder_broken_while_the_process_runs_does_not_stop_captures(tmp_path, damage):
    """The cache's folder removed by hand (or its work/ folder unusable: read-only, disk full)
    after the process opened it: every later capture failed ("FileNotFoundError while
    capturing"), its key served eagerly for good, reset() too."""
    import shutil

    cr.config.cache_dir = tmp_path / "cache"
    _capture(_model(), torch.randn(2, 4))
    if damage == "removed":
        shutil.rmtree(tmp_path / "cache")
    else:
        shutil.rmtree(tmp_path / "cache" / "work")
        (tmp_path / "cache" / "work").write_text("not a folder")
    model, x = torch.nn.Linear(4, 5).eval(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = _capture(model, x)
    assert f.state is cr.CompiledFunction.State.Compiled, f.eager_keys
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))
    if damage == "removed":  # made again, and kept
        other = torch.nn.Linear(4, 6).eval()
        assert _exported(_capture(other, x))
        assert not _exported(_capture(other, x))


def test_a_capture_larger_than_the_whole_cache_is_not_kept_and_says_so_once():
    cr.config.cache_max_bytes = 100  # smaller than any graph
    model, x = _model(), torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"more than the capture cache's bound \(cr.config.cache_max_bytes"):
        f = _capture(model, x)
    torch.testing.assert_close(f(x), model(x))
    assert not list((Path(cr.config.cache_path()) / "entries").iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second one is not said again
        assert _exported(_capture(torch.nn.Linear(4, 5).eval(), x))


def test_the_cache_is_its_owners_alone_and_ignores_symlinked_entries(tmp_path):
    model, x = _model(), torch.randn(2, 4)
    _capture(model, x)
    root = Path(cr.config.cache_path())
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    (entry,) = (root / "entries").iterdir()
    outside = tmp_path / "outside"
    entry.rename(outside)
    entry.symlink_to(outside)
    assert _exported(_capture(model, x))  # the symlinked entry is not followed


def test_cli_cache_info_list_clear(capsys):
    _capture(_model(), torch.randn(2, 4))
    root = str(cr.config.cache_path())
    assert cli(["cache", "info", "--dir", root]) == 0 and "1 entries" in capsys.readouterr().out
    assert cli(["cache", "list", "--dir", root]) == 0 and "Linear(input)" in capsys.readouterr().out
    assert cli(["cache", "clear", "--dir", root]) == 0
    assert cli(["cache", "info", "--dir", root]) == 0 and "0 entries" in capsys.readouterr().out


# Values a graph bakes that are read from outside the model's own file: another module (set from
# the environment, or edited), a helper there, the environment at call time, a file at call time.
SETTINGS = textwrap.dedent("""
    import os

    LIMIT = float(os.environ.get("CLIKA_TEST_LIMIT", "{limit}"))
    FILE = os.path.join(os.path.dirname(__file__), "limit.txt")
    CONFIG = {{"clamp": {{"limit": LIMIT}}}}
    NAME = "CLIKA_TEST_LIMIT"


    class Settings:
        def __init__(self, limit):
            self.limit = limit


    class Limits:
        LIMIT = float(os.environ.get("CLIKA_TEST_LIMIT", "{limit}"))


    OBJECT = Settings(LIMIT)

    def limit():
        return LIMIT
""")

READERS = textwrap.dedent("""
    import os
    import torch
    import {settings}
    from {settings} import LIMIT

    class ReadsModule(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max={settings}.LIMIT)

    class ReadsHelper(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max={settings}.limit())

    class ReadsImported(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max=LIMIT)

    class ReadsDict(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max={settings}.CONFIG["clamp"]["limit"])

    class ReadsObject(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max={settings}.OBJECT.limit)

    class ReadsClass(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max={settings}.Limits.LIMIT)

    class ReadsNamedVariable(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max=float(os.environ.get({settings}.NAME, "10")))

    class ReadsEnvironment(torch.nn.Module):
        def forward(self, x):
            return x.clamp(max=float(os.environ.get("CLIKA_TEST_LIMIT", "10")))

    class ReadsFile(torch.nn.Module):
        def forward(self, x):
            with open({settings}.FILE) as f:
                return x.clamp(max=float(f.read()))
""")

_READ_FROM = {  # the reader, how the value changes between the two "processes"
    "another module's value, from the environment": ("ReadsModule", "environment"),
    "another module's value, edited": ("ReadsModule", "edit"),
    "a helper in another module": ("ReadsHelper", "environment"),
    "a value imported from another module": ("ReadsImported", "environment"),
    "a dict in another module": ("ReadsDict", "environment"),
    "an object's attribute in another module": ("ReadsObject", "environment"),
    "a class attribute in another module": ("ReadsClass", "environment"),
    "a variable named in another module, read from the environment": ("ReadsNamedVariable", "environment"),
    "the environment at call time": ("ReadsEnvironment", "environment"),
    "a file at call time": ("ReadsFile", "file"),
}


def _readers(folder: Path, limit: float, stamp: int):
    """A fresh import of a settings module and the models that read it (as a new process makes)."""
    settings, readers = f"settings_{folder.name}", f"readers_{folder.name}"
    for name in (settings, readers):
        sys.modules.pop(name, None)
    (folder / f"{settings}.py").write_text(SETTINGS.format(limit=limit))
    (folder / f"{readers}.py").write_text(READERS.format(settings=settings))
    for name in (settings, readers):  # the same code: each import is a later process's first
        os.utime(folder / f"{name}.py", ns=(stamp, stamp))
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(readers)
    finally:
        sys.path.remove(str(folder))


@pytest.mark.parametrize("case", _READ_FROM)
def test_a_value_read_outside_the_model_is_in_the_key(case, tmp_path, monkeypatch):
    # A first call inside both limits verifies either graph: only the key can tell them apart.
    reader, change = _READ_FROM[case]
    (tmp_path / "limit.txt").write_text("10")
    monkeypatch.setenv("CLIKA_TEST_LIMIT", "10")
    first = _readers(tmp_path, 10.0, 10**18)
    _capture(getattr(first, reader)(), torch.zeros(2))
    if change == "environment":
        monkeypatch.setenv("CLIKA_TEST_LIMIT", "5")
    elif change == "file":
        (tmp_path / "limit.txt").write_text("5")
    monkeypatch.delenv("CLIKA_TEST_LIMIT") if change == "edit" else None
    later = _readers(tmp_path, 5.0 if change == "edit" else 10.0, 2 * 10**18 if change == "edit" else 10**18)
    f = _capture(getattr(later, reader)(), torch.zeros(2))
    assert _exported(f), f"{case}: the graph made under the old value was restored"
    with torch.no_grad():
        torch.testing.assert_close(f(torch.full((2,), 8.0)), torch.full((2,), 5.0))


GENERATE = textwrap.dedent("""
    import torch, transformers, clika_runtime as cr
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.forward = cr.compile(model.forward)
    with torch.no_grad():
        model.generate(torch.randint(0, 100, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0)
    print(sum("export" in c.phases for c in model.forward.captures), len(model.forward.captures))
""")


@pytest.mark.slow
def test_a_later_process_finds_every_graph_generate_made_the_prefill_too(tmp_path):
    # The prefill bakes tensors its trace makes itself (lifted constants): they are in the graph.
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    runs = [subprocess.run([sys.executable, "-c", GENERATE], capture_output=True, text=True, timeout=300, env=env)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert runs[0].stdout.split() == ["2", "2"] and runs[1].stdout.split() == ["0", "2"], [r.stdout for r in runs]


_REACHED = torch.nn.Linear(4, 4).eval()


def test_a_graph_of_a_model_a_function_reaches_is_found_again_and_watched():
    x = torch.randn(2, 4)
    assert _exported(_capture(lambda t: _REACHED(t) * 2, x))
    f = _capture(lambda t: _REACHED(t) * 2, x)
    assert not _exported(f)  # restored: the model's weights found again through the global
    with torch.no_grad():
        _REACHED.weight.add_(1.0)
        torch.testing.assert_close(f(x), _REACHED(x) * 2)  # and watched
    assert f.recapture_reasons and f.recapture_reasons[-1].startswith("weights changed")


def _embedding(scale: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)).eval()
    with torch.no_grad():
        model[0].weight[5:] *= scale  # rows the first call below does not read
    return model


@pytest.mark.parametrize("reached", ["global", "closure"])
def test_trap_the_weights_of_a_model_a_function_reaches_are_in_the_key(reached):
    """A function that calls a model through a global or a closure bakes that model's weights,
    but only the owner's and closed-over tensors were hashed: a later process whose model differed
    in rows its first call did not read was served the old graph (a CLIP text tower wrapped in a
    function answered tokens >= 50 with the other process's embedding)."""
    global _HELD
    ids = torch.tensor([[1, 2, 3], [0, 4, 1]])
    for scale, exported in ((1.0, True), (1.0, False), (2.0, True)):
        _HELD = model = _embedding(scale)
        fn = (lambda t: _HELD(t)) if reached == "global" else (lambda m: lambda t: m(t))(model)
        f = _capture(fn, ids)
        assert _exported(f) == exported, (scale, exported)
    with torch.no_grad():
        other = torch.tensor([[5, 6, 7]])
        torch.testing.assert_close(f(other), model(other))


_HELD: torch.nn.Module | None = None


def test_trap_forward_hooks_are_in_the_key():
    """A forward hook changes what the graph computes; a later process that added one (a clamp
    its first call did not reach) was served the graph made without it."""
    x = torch.randn(2, 4) * 0.01

    def model(hooked: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        made = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)).eval()
        if hooked:
            made[2].register_forward_hook(lambda module, args, out: out.clamp(-1.0, 1.0))
        return made

    assert _exported(_capture(model(False), x))
    assert not _exported(_capture(model(False), x))
    f = _capture(model(True), x)
    assert _exported(f)
    with torch.no_grad():
        big = torch.randn(2, 4) * 100
        torch.testing.assert_close(f(big), model(True)(big))


def test_trap_a_cached_graph_changed_on_disk_is_never_handed_out():
    """A cache entry's ``model.onnx`` altered on disk (a weight), its optimised copy left as it
    was: the next process served right (the optimised file is what runs, and it is checked
    against eager), but ``take_graph()`` handed out the altered file, which ``save`` then gave a
    valid digest. Handing out a restored graph now checks its files against the digests the
    entry recorded, and refuses with the fix."""
    import onnx
    from onnx import numpy_helper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)
    _capture(model, x)
    (stored,) = Path(cr.config.cache_dir).glob("entries/*/model.onnx")
    proto = onnx.load(str(stored))
    weight = proto.graph.initializer[0]
    changed = numpy_helper.to_array(weight).copy()
    changed.flat[0] += 1.0
    weight.CopyFrom(numpy_helper.from_array(changed, weight.name))
    stored.unlink()  # a new file of the same size: the first function's linked copy keeps its own
    onnx.save(proto, str(stored))
    again = _capture(model, x)
    assert not _exported(again), "the entry was not restored: nothing to test"
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))  # what runs was checked
    with pytest.raises(cr.GraphFileError, match="disk cache.*changed since it was stored.*cache clear"):
        again.take_graph()
    assert again.state is cr.CompiledFunction.State.Compiled  # still serving what was checked


def test_trap_folders_a_killed_process_left_in_the_cache_are_removed(tmp_path):
    """A server stopped by SIGTERM or SIGKILL runs no clean-up: its live captures' folders stayed
    in ``<cache_dir>/work/`` for good (about 3x the weights each stop), counted by nothing and
    left by ``cache clear``. A cache opened, or cleared, removes those of processes of this host
    that are gone, and keeps those of live ones."""
    script = ("import os, torch, clika_runtime as cr\n"
              f"cr.config.cache_dir = {str(tmp_path)!r}\n"
              "f = cr.compile(torch.nn.Linear(64, 64).eval())\n"
              "with torch.no_grad(): f(torch.randn(2, 64))\n"
              "os._exit(0)  # as SIGKILL would: no clean-up\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    left = list((tmp_path / "work").iterdir())
    assert left, "the killed process left no folder: nothing to test"
    mine = cr.compile(torch.nn.Linear(4, 4).eval())
    cr.config.cache_dir = str(tmp_path)
    with torch.no_grad():
        mine(torch.randn(2, 4))  # this process opens the cache: its own live folder stays
    alive = [p for p in (tmp_path / "work").iterdir() if p not in left]
    assert not [p for p in left if p.exists()], left
    assert alive and all(p.exists() for p in alive)
    assert cli(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert all(p.exists() for p in alive)  # a live process's folder survives a clear


def test_trap_folders_a_killed_process_left_in_the_temp_dir_are_removed(tmp_path):
    """With the disk cache off (``cache_dir = None``), captures and loaded graphs keep their
    files in the system's temp folder. A server killed there (OOM, SIGKILL) left them for good:
    a real-size model's graphs (hundreds of MB) a restart, and a restart loop filled ``/tmp``.
    The next process's first graph folder removes the folders processes of this host left when
    they died, including an int8 quantization's scratch folder, and keeps live ones'."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    killed = ("import os, tempfile, torch, clika_runtime as cr\n"
              "from clika_runtime.base.owners import owned\n"
              "cr.config.cache_dir = None\n"
              "f = cr.compile(torch.nn.Linear(64, 64).eval())\n"
              "with torch.no_grad(): f(torch.randn(2, 64))\n"
              "open(os.path.join(tempfile.gettempdir(), 'clika_runtime.notes'), 'w').close()  # the user's\n"
              "tempfile.mkdtemp(prefix=owned('clika_runtime'))  # as a quantization's scratch folder\n"
              "os._exit(0)  # as SIGKILL would: no clean-up\n")
    subprocess.run([sys.executable, "-c", killed], check=True, timeout=300, env=env, cwd=ROOT)
    left = [p for p in tmp_path.iterdir() if p.name.startswith("clika_runtime.") and p.is_dir()]
    assert len(left) == 2, "the killed process left too few folders: nothing to test"
    living = ("import os, tempfile, torch, clika_runtime as cr\n"
              "cr.config.cache_dir = None\n"
              "f = cr.compile(torch.nn.Linear(4, 4).eval())\n"
              "with torch.no_grad(): f(torch.randn(2, 4))\n"
              "print(sorted(n for n in os.listdir(tempfile.gettempdir()) if n.startswith('clika_runtime.') and n != 'clika_runtime.notes'))\n")
    out = subprocess.run([sys.executable, "-c", living], check=True, timeout=300, env=env, cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert not [p for p in left if p.exists()], left
    assert eval(out.splitlines()[-1]), "the live process's own folder went too"
    assert (tmp_path / "clika_runtime.notes").is_file()  # not named by a process: not ours to remove


def test_trap_folders_forked_workers_left_are_removed_while_the_parent_lives(tmp_path):
    """A server recycling fork workers (a Pool with maxtasksperchild, gunicorn, celery) opened
    the cache once, in the parent: each worker's captures left a folder in work/ as it exited,
    and nothing removed them while the parent lived (41 folders, 30 MiB against a 2 MiB bound
    after 20 rounds). Each capture now removes those of processes that are gone."""
    cr.config.cache_dir = str(tmp_path)
    _capture(_model(), torch.randn(2, 4))  # the parent opens the cache
    worker = os.fork()
    if worker == 0:  # a worker: captures, then exits as a pool worker does (no clean-up)
        try:
            served = _capture(torch.nn.Linear(4, 7).eval(), torch.randn(2, 4))  # noqa: F841 (kept to the end)
        finally:
            os._exit(0)
    os.waitpid(worker, 0)
    left = [p for p in (tmp_path / "work").iterdir() if f".{worker}." in p.name]
    assert left, "the worker left no folder: nothing to test"
    _capture(torch.nn.Linear(4, 9).eval(), torch.randn(2, 4))  # the parent's next capture
    assert not [p for p in left if p.exists()], left


def test_trap_weights_swapped_while_a_graph_is_restored_are_not_served_stale(monkeypatch):
    """Another thread's load_state_dict landing between a capture's eager run and the disk-cache
    restore: the entry found for the old weights (verified against the eager run, which had them)
    was installed watching the new weights' versions, and served the old checkpoint until the
    next swap (a trial: 59 stale answers in 1.3 million calls)."""
    from clika_runtime.cache import restore

    torch.manual_seed(0)
    old, new = torch.nn.Linear(4, 3).state_dict(), torch.nn.Linear(4, 3).state_dict()
    model, x = torch.nn.Linear(4, 3).eval(), torch.randn(2, 4)
    model.load_state_dict(old)
    _capture(model, x)  # the old weights' graph, in the disk cache
    found_again = restore.found_again

    def swapped_meanwhile(*args, **kwargs):  # the other thread's swap lands here
        monkeypatch.setattr(restore, "found_again", found_again)
        model.load_state_dict(new)
        return found_again(*args, **kwargs)

    monkeypatch.setattr(restore, "found_again", swapped_meanwhile)
    f = _capture(model, x)  # eager with the old weights, then the swap, then the restore
    assert model.weight.data_ptr() and torch.equal(model.weight.detach(), new["weight"])
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x))  # the new weights' answer
        torch.testing.assert_close(f(x), model(x))


@pytest.mark.parametrize("action", ["info", "list", "clear"])
def test_trap_the_cache_command_reads_a_folder_without_making_it(action, tmp_path, capsys):
    # `cache info --dir` made entries/, functions/ and work/ in a folder that did not exist (a trial).
    absent = tmp_path / "absent"
    assert cli(["cache", action, "--dir", str(absent)]) == 0
    assert not absent.exists()
    assert f"{absent}: no capture cache there" in capsys.readouterr().out


def test_trap_the_cache_command_refuses_an_empty_dir_rather_than_clear_the_default(tmp_path, capsys):
    # `cache clear --dir ""` cleared the default cache (an attack found it).
    assert cli(["cache", "clear", "--dir", ""]) == 2
    assert "--dir: an empty path" in capsys.readouterr().err


def test_trap_a_target_the_fingerprint_cannot_read_is_captured_without_the_cache():
    # A torch.jit.trace'd module's class refuses `cls.forward`: warming its fingerprint raised, and
    # the call was reported as "a bug in clika_runtime" and served eagerly for good (a trial).
    traced = torch.jit.trace(torch.nn.Linear(8, 4).eval(), torch.randn(3, 8))
    f = cr.compile(traced)
    x = torch.randn(3, 8)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(x)
        torch.testing.assert_close(f(x), traced(x))
    assert not [w for w in caught if "bug in clika_runtime" in str(w.message)], [str(w.message) for w in caught]


@dataclasses.dataclass
class _Act:
    mode: str


def _activated(x, act):
    return x.relu() if act.mode == "relu" else x


def test_trap_the_disk_cache_keys_an_object_static_by_its_value():
    # The cache key wrote an object static as its class alone: a function called with
    # _Act("identity") found _Act("relu")'s graph, which agreed with eager on the capturing call's
    # positive input and then served relu (found by an attack).
    positive, mixed = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 2.0, -3.0])
    with torch.no_grad():
        cr.compile(_activated)(positive, _Act("relu"))
        other = cr.compile(_activated)
        other(positive, _Act("identity"))
        assert "export" in other.captures[0].phases  # its own graph, not the relu one
        torch.testing.assert_close(other(mixed, _Act("identity")), mixed)


_BOUND = textwrap.dedent("""
    import sys, torch, clika_runtime as cr
    class Scaler:
        def __init__(self, k): self.k = k
        def apply(self, x): return x * self.k
    def add_one(x, op): return op(x) + 1
    f = cr.compile(add_one)
    scaler = Scaler(float(sys.argv[1]))  # not a global plain value: the key would hold it
    with torch.no_grad():
        f(torch.zeros(3), scaler.apply)  # both processes agree here: 1.0
        print(f(torch.ones(3), scaler.apply).tolist())
""")


@pytest.mark.slow
def test_trap_a_bound_method_static_never_finds_another_processs_graph(tmp_path):
    # Its disk key named the method alone: a process with Scaler(3.0).apply was served the graph
    # of Scaler(2.0).apply (3.0 where eager gives 4.0: found by an attack on this stop's key).
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    answers = []
    for k in ("2", "3"):
        result = subprocess.run([sys.executable, "-c", _BOUND, k], capture_output=True, text=True, timeout=300,
                                env=env, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        answers.append(result.stdout.strip())
    assert answers == ["[3.0, 3.0, 3.0]", "[4.0, 4.0, 4.0]"], answers


class _Scaling:
    def __init__(self, k: float) -> None:
        self.k = k

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class _Holding(torch.nn.Module):
    """A module whose attribute is a plain object or a method bound to one: its value decides the graph."""

    def __init__(self, held) -> None:
        super().__init__()
        self.held = held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.held, np.ndarray):
            return x * torch.from_numpy(self.held).float()
        return self.held(x) if callable(self.held) else _activated(x, self.held)


class _LockedAct:
    """An object whose fields cannot all be read as values (a lock): it keys this process's object."""

    def __init__(self, mode: str) -> None:
        self.mode, self.lock = mode, threading.Lock()


@pytest.mark.parametrize("first, second, mixed_answer", [
    (_Act("relu"), _Act("identity"), [-1.0, 2.0, -3.0]),
    (_Scaling(1.0).apply, _Scaling(-1.0).apply, [1.0, -2.0, 3.0]),
    (_LockedAct("relu"), _LockedAct("identity"), [-1.0, 2.0, -3.0]),
    (np.array([1.0, 1.0, 1.0]), np.array([1.0, -1.0, 1.0]), [-1.0, -2.0, -3.0]),
], ids=["object", "bound-method", "unreadable-object", "numpy-array"])
def test_trap_the_disk_cache_keys_a_modules_object_attribute_by_its_value(first, second, mixed_answer):
    # The key wrote a module's attribute holding a plain object as its class, and a bound method as
    # its function: a module holding _Act("identity") found the graph of one holding _Act("relu"),
    # agreeing on the capturing call's input (zeros), then served relu.
    zeros, mixed = torch.zeros(3), torch.tensor([-1.0, 2.0, -3.0])
    with torch.no_grad():
        cr.compile(_Holding(first))(zeros)
        other = cr.compile(_Holding(second))
        other(zeros)
        assert "export" in other.captures[0].phases  # its own graph
        assert other(mixed).tolist() == mixed_answer


def test_trap_the_attention_fast_path_setting_is_in_the_key():
    # A process with torch.backends.mha's fast path off restored a graph made with it on: the first
    # call (no padding) agreed, then padded positions were served as zeros where eager computes them.
    def encoder() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1).eval()

    x, unpadded = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    padded = unpadded.clone()
    padded[1, 3:] = True
    with torch.inference_mode():
        cr.compile(encoder())(x, src_key_padding_mask=unpadded)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            model = encoder()
            other = cr.compile(model)
            other(x, src_key_padding_mask=unpadded)
            assert "export" in other.captures[0].phases  # its own graph
            torch.testing.assert_close(other(x, src_key_padding_mask=padded), model(x, src_key_padding_mask=padded))
        finally:
            torch.backends.mha.set_fastpath_enabled(True)


def test_a_modules_numpy_array_keys_the_cache_by_its_content():
    # Unhashable, an array would key this process's object alone: a later process never found the graph.
    zeros = torch.zeros(3)
    with torch.no_grad():
        cr.compile(_Holding(np.array([1.0, 2.0, 3.0])))(zeros)
        same = cr.compile(_Holding(np.array([1.0, 2.0, 3.0])))
        same(zeros)
    assert "export" not in same.captures[0].phases  # restored: an equal array, another object


class _AnyName:
    """An attribute-style config: unset names read as None (its ``__getattr__`` answers any name)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __getattr__(self, name: str):
        return None


@dataclasses.dataclass
class _Derived:
    """A dataclass whose limit comes through an InitVar: not one of its fields."""

    name: str
    limit_in: dataclasses.InitVar[float] = 1.0

    def __post_init__(self, limit_in: float) -> None:
        self.limit = limit_in


class _Clamped(torch.nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(max=self.cfg.limit)


@pytest.mark.parametrize("config", [_AnyName, lambda limit: _Derived("a", limit)], ids=["getattr", "initvar"])
def test_trap_a_config_read_past_its_fields_keys_the_cache_by_its_values(config):
    # An attribute-style config keyed as "wrapping(None)" (asked for __wrapped__, it answered), and
    # a dataclass by its fields alone: limit 3 restored limit 2's graph (an attack: 2.0 for 3.0).
    ones, tens = torch.ones(3), torch.full((3,), 10.0)
    with torch.no_grad():
        cr.compile(_Clamped(config(2.0)))(ones)
        other = cr.compile(_Clamped(config(3.0)))
        other(ones)
        assert "export" in other.captures[0].phases  # its own graph
        assert other(tens).tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("pid", [str(10**20), "²", "-5", "0"])
def test_trap_a_folder_named_with_an_impossible_pid_is_left_alone_and_breaks_nothing(tmp_path, pid):
    """Anyone can make a folder in the shared temp folder: one named like a dead process's graph
    folder with a pid too large for ``os.kill`` made every later graph folder raise OverflowError,
    and so every capture and every load of a graph with external data."""
    from clika_runtime.base import owners

    odd = tmp_path / f"clika_runtime.{pid}.{owners._HOST}.x"
    odd.mkdir()
    owners.remove_abandoned(tmp_path, owners.OWNED)
    assert odd.is_dir()
