"""Saved graphs are written atomically and carry a content digest (issue 26, items 1 and 2).

- a process loading and calling a graph while another saves it (through ``save``, and by writing
  the file in place as other tools do) is never killed and never served half a graph;
- a flipped byte anywhere in the weights or the graph is refused by ``cr.load``,
  ``ModelGraph.load`` and ``clika-runtime validate``, naming what changed;
- graphs saved before digests load as before, with a note.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import clika_runtime as cr
from clika_runtime.base.errors import GraphFileError
from clika_runtime.cli import main as cli
from clika_runtime.format import digest
from clika_runtime.format.metadata import META_DIGEST
from clika_runtime.shipped.validation import validate_graph

WIDTH = 256  # 0.5 MiB of weights: writes long enough for a reader to meet them half done


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 16)).eval()


@pytest.fixture(scope="module")
def pair():
    """Two graphs of one structure with different weights, an input, and each one's output."""
    x = torch.randn(3, WIDTH)
    graphs, outputs = [], []
    for seed in (1, 2):
        model = _mlp(seed)
        f = cr.compile(model)
        with torch.inference_mode():
            f(x)
            f(x)
            graphs.append(f.take_graph())
            outputs.append(model(x).numpy())
    assert not np.allclose(outputs[0], outputs[1])
    return graphs, x.numpy(), outputs


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    """The first graph saved with its weights inline, and again with external data."""
    folder = tmp_path_factory.mktemp("saved")
    graph = pair[0][0]
    return graph.save(folder / "inline.onnx"), graph.save(folder / "ext" / "model.onnx", external_data=True)


# ------------------------------------------------------------------------------ concurrent save/load

READER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import clika_runtime as cr
    from clika_runtime.base.errors import GraphFileError
    path, seconds = sys.argv[1], float(sys.argv[2])
    arrays = np.load(sys.argv[3])
    x, expected = arrays["x"], [arrays["a"], arrays["b"]]
    counts = {"a": 0, "b": 0, "refused": 0, "wrong": 0, "errors": []}
    print("ready", flush=True)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        try:
            served = cr.load(path) if i % 2 else cr.ModelGraph.load(path).serve("cpu")
            out = served(x)
        except GraphFileError as e:
            counts["refused"] += 1
            if len(counts["errors"]) < 5:
                counts["errors"].append(str(e)[:200])
            continue
        match = [k for k, want in zip("ab", expected) if np.allclose(out, want, rtol=1e-4, atol=1e-5)]
        counts[match[0] if match else "wrong"] += 1
    print(json.dumps(counts), flush=True)
""")


def test_a_reader_never_dies_nor_serves_half_a_graph_while_a_writer_saves(pair, tmp_path):
    """The writer alternates the two graphs, inline and with external data, through ``save``, and
    now and then writes the file in place (truncating it first), as ``cp`` or another tool would:
    every call the reader makes is served one of the two graphs whole, or refused."""
    (a, b), x, (want_a, want_b) = pair
    path = tmp_path / "model.onnx"
    a.save(path)
    in_place = [a.save(tmp_path / "copies" / "a.onnx").read_bytes(), b.save(tmp_path / "copies" / "b.onnx").read_bytes()]
    np.savez(tmp_path / "expected.npz", x=x, a=want_a, b=want_b)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), "5", str(tmp_path / "expected.npz")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
        saves = 0
        while reader.poll() is None:
            saves += 1
            if saves % 5 == 0:  # a foreign writer: truncate, then write, in place
                path.write_bytes(in_place[saves % 2])
            else:
                (a, b)[saves % 2].save(path, external_data=bool(saves // 2 % 2))
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, f"reader died with {reader.returncode} (SIGBUS is -7): {err[-2000:]}"
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["wrong"] == 0, counts
    assert counts["a"] + counts["b"] > 0 and saves > 10, (counts, saves)
    print(f"{saves} saves; reader: {counts}")


def test_trap_a_data_file_rewritten_under_a_served_graph_changes_nothing_it_serves(pair, saved, tmp_path):
    """onnxruntime maps a graph's external data file: rewritten in place while a loaded graph
    served (``cp`` over it), the server was served the new bytes, unchecked (0.14 off), and when
    it was cut short died of SIGBUS. A loaded graph now serves a private copy of the files its
    digest checked."""
    _, x, (want, _) = pair
    path = _copied(saved[1], tmp_path / "served")
    served = cr.load(path)
    np.testing.assert_allclose(served(x), want, rtol=1e-4, atol=1e-5)
    data_file = next(p for p in path.parent.iterdir() if p.name.endswith(".data"))
    size = data_file.stat().st_size
    with open(data_file, "r+b") as file:  # in place: the same inode, as cp over it writes
        file.write(b"\x00" * size)
    np.testing.assert_allclose(served(x), want, rtol=1e-4, atol=1e-5)
    script = ("import sys, numpy as np, clika_runtime as cr\n"
              "served = cr.load(sys.argv[1]); x = np.load(sys.argv[2])\n"
              "served(x); open(sys.argv[3], 'r+b').truncate(0)\n"
              "print(float(np.abs(served(x)).sum()))\n")
    _copied(saved[1], tmp_path / "cut")
    np.save(tmp_path / "x.npy", x)
    cut = next(p for p in (tmp_path / "cut").iterdir() if p.name.endswith(".data"))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cut" / path.name), str(tmp_path / "x.npy"),
                           str(cut)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the server died with {done.returncode} (SIGBUS is -7): {done.stderr[-1000:]}"
    assert float(done.stdout) == pytest.approx(float(np.abs(want).sum()), rel=1e-4)


def test_trap_a_graph_with_external_data_loads_where_the_temp_folder_is_unusable(pair, saved, tmp_path, monkeypatch):
    """The private copy needs a writable temp folder with room for the weights: where there is
    none, loading raised a bare NotADirectoryError. It opens the files where they are, and says
    that a rewrite in place can then reach the served graph."""
    import tempfile

    _, x, (want, _) = pair
    (tmp_path / "not_a_folder").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not_a_folder"))
    with pytest.warns(UserWarning, match="cannot copy .* external data .* opened where it is"):
        served = cr.load(saved[1])
    np.testing.assert_allclose(served(x), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------- flipped bytes


def _flipped(source: Path, folder: Path, position: int, data_file: str | None = None) -> Path:
    """A copy of the saved model (and its data) with the byte at ``position`` inverted, in the model
    file, or in ``data_file`` when given."""
    copy = _copied(source, folder)
    target = folder / (data_file or source.name)
    content = bytearray(target.read_bytes())
    content[position] ^= 0xFF
    target.write_bytes(bytes(content))
    return copy


def _copied(source: Path, folder: Path) -> Path:
    """A copy of a saved model's folder."""
    folder.mkdir()
    for file in source.parent.iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    return folder / source.name


def _refusal(path: Path) -> str:
    """How cr.load, ModelGraph.load and validate refuse a file: "digest" or "unreadable"."""
    with pytest.raises(GraphFileError) as caught:
        cr.load(path)
    with pytest.raises(GraphFileError):
        cr.ModelGraph.load(path)
    assert cli(["validate", str(path)]) != 0
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    if "content digest mismatch" in message:
        assert "expected sha256" in message and "found sha256" in message
        return "digest"
    return "digest entry" if "malformed content digest entry" in message else "unreadable"


def _positions(path: Path) -> dict[str, int]:
    """Byte positions of a saved model file, by what they hold."""
    data = path.read_bytes()
    model = onnx.load_model(str(path), load_external_data=False)
    weight = numpy_helper.to_array(model.graph.initializer[0]).tobytes()
    guard = next(p.value for p in model.metadata_props if p.key == "clika_runtime.guard")
    node = model.graph.node[0]
    return {
        "weight, first byte": data.find(weight),
        "weight, middle": data.find(weight) + len(weight) // 2,
        "op type": data.find(node.op_type.encode()),
        "node input name": data.find(node.input[0].encode()) + 1,
        "graph input dim": data.find(b"x_dim0") if b"x_dim0" in data else data.find(model.graph.input[0].name.encode()),
        "guard metadata": data.find(guard.encode()) + len(guard) // 2,
        "opset version": data.rfind(b"\x10" + bytes([model.opset_import[0].version])) + 1,
        "digest, graph hex": data.find(b'"graph":"') + 12,
        "digest, a tensor's hex": data.find(b'"tensors":["') + 15,
    }


def test_a_flipped_byte_in_the_graph_or_its_weights_is_refused(saved, tmp_path):
    inline, _ = saved
    positions = _positions(inline)
    assert all(p > 0 for p in positions.values()), positions
    rng = np.random.default_rng(0)
    data = inline.read_bytes()
    entry = data.find(META_DIGEST.encode())
    # Anywhere else in the file, past the digest entry's key (a flip there makes the entry another
    # metadata key: the file then reads as one without a digest, its content as saved).
    positions.update({f"random {i}": int(p) for i, p in enumerate(rng.integers(entry + len(META_DIGEST), len(data), 8))})
    kinds = {}
    for i, (what, position) in enumerate(positions.items()):
        kinds[what] = _refusal(_flipped(inline, tmp_path / f"flip{i}", position))
    assert kinds["weight, middle"] == kinds["guard metadata"] == kinds["op type"] == "digest", kinds
    print(kinds)


def test_a_flipped_byte_in_external_data_names_the_tensor(saved, tmp_path):
    _, external = saved
    data_file = next(p for p in external.parent.iterdir() if p.name.endswith(".data"))
    size = data_file.stat().st_size
    for i, position in enumerate((0, size // 2, size - 1)):
        path = _flipped(external, tmp_path / f"flip{i}", position, data_file.name)
        with pytest.raises(GraphFileError, match=r"content digest mismatch: tensor '[^']+': expected sha256 \w+"):
            cr.load(path)
        assert _refusal(path) == "digest"
    # Opting out: the file loads (and serves its changed weights).
    assert cr.load(path, verify_digest=False) is not None
    assert cr.ModelGraph.load(path, verify_digest=False).input_names == ["input"]
    assert cli(["validate", str(path), "--no-digest"]) == 0


def test_a_data_file_cut_short_or_gone_is_refused_not_a_signal(saved, tmp_path):
    _, external = saved
    path = _copied(external, tmp_path / "cut")
    data_file = next(p for p in path.parent.iterdir() if p.name.endswith(".data"))
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    with pytest.raises(GraphFileError, match="external data .* holds .* bytes, the tensor reads"):
        cr.load(path)
    data_file.unlink()  # a reader that read the model just before a save removed its data file
    for load in (cr.load, cr.ModelGraph.load):
        with pytest.raises(GraphFileError, match="external data location .* names no file") as caught:
            load(path)
        assert "not a readable" not in str(caught.value)


# --------------------------------------------------------------------------- what the digest covers


def test_one_digest_whether_weights_are_inline_or_external_and_after_onnx_rewrites_the_file(saved, tmp_path):
    inline, external = saved
    records = []
    for path in (inline, external):
        found = digest.verify(path.read_bytes(), path.parent, str(path))
        records.append(found.computed)
        assert found.recorded == found.computed.record()
    assert records[0] == records[1]
    # The digest entry is the file's first field: a file cut short never lacks only its digest.
    assert inline.read_bytes()[0] == 0x72 and inline.read_bytes().find(META_DIGEST.encode()) < 8  # field 14's tag
    # onnx reads and writes it again (fields back in number order): still the same content.
    rewritten = tmp_path / "rewritten.onnx"
    onnx.save_model(onnx.load_model(str(inline)), str(rewritten))
    assert cr.load(rewritten) is not None
    # A change made through onnx is a change: the metadata that ships the guard, here.
    model = onnx.load_model(str(inline))
    model.doc_string = "edited"
    onnx.save_model(model, str(rewritten))
    with pytest.raises(GraphFileError, match=r"content digest mismatch: graph \(nodes, names, shapes, metadata\)"):
        cr.load(rewritten)


def test_trap_a_flipped_bit_in_the_digest_entrys_key_does_not_turn_the_check_off(saved, tmp_path):
    inline, _ = saved
    data = inline.read_bytes()
    key = data.find(META_DIGEST.encode())
    weight = data.find(numpy_helper.to_array(onnx.load_model(str(inline)).graph.initializer[0]).tobytes())
    for i, position in enumerate((key, key + 5, key + len(META_DIGEST) - 1)):
        damaged = _copied(inline, tmp_path / f"key{i}")
        content = bytearray(damaged.read_bytes())
        content[position] ^= 0x10  # the entry is now another key: the file reads as one without a digest
        content[weight + 3] ^= 0x40  # and a weight changed
        damaged.write_bytes(bytes(content))
        with pytest.raises(GraphFileError, match=r"its content digest lies under the metadata key '.+', not "
                                                 r"'clika_runtime.digest': the file changed after it was saved"):
            cr.load(damaged)
        with pytest.raises(GraphFileError, match="its content digest lies under the metadata key"):
            cr.ModelGraph.load(damaged)
        assert cli(["validate", str(damaged)]) == 1


def test_graphs_saved_before_digests_load_as_before_with_a_note(pair, tmp_path, caplog):
    # Also a graph written by onnx's own save, as users do after an edit (refusing these was a
    # regression a trial of this stop's first fix found).
    (a, _), x, (want_a, _) = pair
    old = tmp_path / "old.onnx"
    onnx.save_model(a.model_proto, str(old))  # what save wrote before digests
    assert META_DIGEST not in {p.key for p in onnx.load_model(str(old)).metadata_props}
    with caplog.at_level(logging.INFO, logger="clika_runtime"):
        np.testing.assert_allclose(cr.load(old)(x), want_a, rtol=1e-4, atol=1e-5)
        cr.ModelGraph.load(old)
    notes = [r.getMessage() for r in caplog.records if "carries no content digest" in r.getMessage()]
    assert len(notes) == 2 and str(old) in notes[0]
    assert cli(["validate", str(old)]) == 0
    row = next(c for c in validate_graph(old).checks if c.name == "content digest")
    assert row.passed and "none recorded" in row.detail


# ---------------------------------------------------------------------------------- atomic writes


def test_trap_saving_onto_a_folder_says_so_in_one_line(pair, tmp_path):
    (a, _), _, _ = pair
    with pytest.raises(IsADirectoryError, match=rf"save: {tmp_path} is a folder: give a file path, e.g. .*model\.onnx$"):
        a.save(tmp_path)
    with pytest.raises(IsADirectoryError, match=r"names a folder: give a file path"):
        a.save(f"{tmp_path}/new/")  # a folder to be: it wrote a file named "new"
    assert list(tmp_path.iterdir()) == []


def test_trap_saving_onto_a_pipe_or_device_refuses_and_onto_a_link_writes_through(pair, tmp_path):
    """``save`` replaced whatever the path named: a FIFO (and, run as root, ``/dev/null``) became a
    regular file, and a symbolic link was replaced by the file instead of writing where it
    points (a ``current.onnx`` link to a versioned file). A path that is not a regular file is
    refused; a link is written through, atomically, and stays a link."""
    import os
    import stat

    (a, _), x, (want, _) = pair
    pipe = tmp_path / "pipe.onnx"
    os.mkfifo(pipe)
    with pytest.raises(FileExistsError, match=rf"save: {pipe} is a FIFO, not a regular file"):
        a.save(pipe)
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    versioned = tmp_path / "v3" / "model.onnx"
    versioned.parent.mkdir()
    link = tmp_path / "current.onnx"
    link.symlink_to(versioned)
    for external in (False, True):
        a.save(link, external_data=external)
        assert link.is_symlink() and versioned.is_file()
        # External data lies beside the file written; a graph loaded through a link reads it there.
        np.testing.assert_allclose(cr.load(link)(x), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(cr.ModelGraph.load(link).serve()(x), want, rtol=1e-4, atol=1e-5)
    loop = tmp_path / "loop.onnx"
    loop.symlink_to(tmp_path / "loop.onnx")
    with pytest.raises(OSError, match=r"save: .*loop\.onnx is a symbolic link loop"):
        a.save(loop)


def test_trap_a_graph_without_weights_saves_with_external_data_asked_for(tmp_path):
    """``save(external_data=True)`` of a graph holding no weights (a softmax) raised
    FileNotFoundError on a temporary data file it never wrote. It saves the model alone."""
    f = cr.compile(lambda x: torch.softmax(x, -1))
    x = torch.randn(2, 5)
    f(x)
    path = f.take_graph().save(tmp_path / "softmax.onnx", external_data=True)
    assert [p.name for p in tmp_path.iterdir()] == ["softmax.onnx"]
    np.testing.assert_allclose(cr.load(path)(x.numpy()), torch.softmax(x, -1).numpy(), rtol=1e-5, atol=1e-6)


def test_a_digest_record_a_tool_kept_under_another_key_loads_as_a_file_without_one(pair, saved, tmp_path, caplog):
    # Refusing any record under another key refused files whose metadata a tool renamed or kept
    # as provenance (an attack on the first fix): only our key with one bit flipped is damage.
    _, x, (want, _) = pair
    inline, _ = saved
    model = onnx.load_model(str(inline))
    for entry in model.metadata_props:
        if entry.key == META_DIGEST:
            entry.key = "parent.digest"
    kept = tmp_path / "kept.onnx"
    onnx.save_model(model, str(kept))
    with caplog.at_level(logging.INFO, logger="clika_runtime"):
        np.testing.assert_allclose(cr.load(kept)(x), want, rtol=1e-4, atol=1e-5)
    assert any("carries no content digest" in r.getMessage() and str(kept) in r.getMessage() for r in caplog.records)
    assert cli(["validate", str(kept)]) == 0


def test_a_loaded_graph_holds_no_digest_a_change_would_make_stale(saved, tmp_path):
    # The digest is the file's: a loaded graph's model_proto kept it, so quantized() of it, or
    # onnx.save after an edit, carried a digest of the old content (refused as corrupt).
    inline, _ = saved
    loaded = cr.ModelGraph.load(inline)
    assert META_DIGEST not in {p.key for p in loaded.model_proto.metadata_props}
    onnx.save_model(loaded.model_proto, str(tmp_path / "resaved.onnx"))
    cr.load(tmp_path / "resaved.onnx")


def test_save_names_external_data_by_content_and_leaves_nothing_else(pair, tmp_path):
    (a, b), x, (want_a, want_b) = pair
    path = tmp_path / "model.onnx"
    a.save(path, external_data=True)
    first = sorted(p.name for p in tmp_path.iterdir())
    assert len(first) == 2 and first[1].startswith("model.onnx.") and first[1].endswith(".data")
    a.save(path, external_data=True)  # the same content: the same names
    assert sorted(p.name for p in tmp_path.iterdir()) == first
    b.save(path, external_data=True)  # another content: another data file, the old one gone
    second = sorted(p.name for p in tmp_path.iterdir())
    assert len(second) == 2 and second != first
    np.testing.assert_allclose(cr.load(path)(x), want_b, rtol=1e-4, atol=1e-5)
    (tmp_path / "model.onnx.data").write_bytes(b"written by an earlier version")
    a.save(path)  # inline: no data file is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    np.testing.assert_allclose(cr.load(path)(x), want_a, rtol=1e-4, atol=1e-5)


def test_a_reader_holding_the_old_model_keeps_reading_it(pair, tmp_path):
    """A rename replaces the name, not the file: what a reader opened stays whole."""
    (a, b), _, _ = pair
    path = a.save(tmp_path / "model.onnx")
    with path.open("rb") as held:
        b.save(path)
        old = held.read()
    assert digest.verify(old, tmp_path, "held").computed == digest.verify(a.save(tmp_path / "again.onnx").read_bytes(),
                                                                           tmp_path, "again").computed


def test_triton_versions_switch_layout_and_carry_the_digest(pair, tmp_path):
    (a, b), x, (want_a, want_b) = pair
    folder = a.to_triton(tmp_path / "repo", "m")
    b.to_triton(tmp_path / "repo", "m", external_data=True)  # file -> folder
    inner = folder / "1" / "model.onnx" / "model.onnx"
    np.testing.assert_allclose(cr.load(inner)(x), want_b, rtol=1e-4, atol=1e-5)
    a.to_triton(tmp_path / "repo", "m")  # folder -> file
    np.testing.assert_allclose(cr.load(folder / "1" / "model.onnx")(x), want_a, rtol=1e-4, atol=1e-5)
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.onnx"]
    assert cli(["validate", str(folder)]) == 0


def test_take_graph_reads_a_capture_whose_data_file_the_disk_cache_linked(tmp_path):
    """Past 16 MiB a capture keeps its weights in a data file, which the disk cache hard-links into
    its entry; onnx refuses to read a file with several links (it took that for an attack)."""
    cr.config.cache_dir = tmp_path / "cache"
    model = torch.nn.Linear(2048, 2048).eval()
    f = cr.compile(model)
    x = torch.randn(2, 2048)
    with torch.inference_mode():
        f(x)
        f(x)
        graph = f.take_graph()
    served = cr.load(graph.save(tmp_path / "big.onnx"))
    with torch.inference_mode():
        torch.testing.assert_close(served(x), model(x), rtol=1e-4, atol=1e-4)


def test_tensors_reading_one_region_over_and_over_are_refused_not_hashed_for_hours(saved, tmp_path):
    _, external = saved
    path = _copied(external, tmp_path / "overlap")
    model = onnx.load_model(str(path), load_external_data=False)
    first = next(t for t in model.graph.initializer if t.external_data)
    for i in range(3):  # three more tensors on the first one's bytes
        copy = model.graph.initializer.add()
        copy.CopyFrom(first)
        copy.name = f"again_{i}"
    onnx.save_model(model, str(path))
    with pytest.raises(GraphFileError, match="more than twice over"):
        cr.load(path)
