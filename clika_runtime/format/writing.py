"""A graph file written for shipping: whole, beside its target, renamed into place, with its digest.

A reader (``cr.load``, ``validate``, a server, Triton polling its repository) that opens the file
while it is written sees the old file or the new one, never part of one: each file is written
under a temporary name in the target's folder, flushed to the disk, and renamed over the target
(``os.replace``: atomic within a filesystem; a reader that opened the old file keeps reading it).

A model with external data is two files. Its data file is named after the model's content digest
(``<name>.<16 hex digits>.data``) and renamed into place first, then the model that names it: a
reader never opens a new model with an old data file or the reverse, whatever the timing, and a
save of the same content leaves the same names. Data files of earlier saves of the same name are
removed after the model is in place; a reader that opened the old model in the moment between
gets ``GraphFileError`` (its data file is gone), never the new data under the old model.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterable, Iterator

from clika_runtime.format import digest
from clika_runtime.format.graphfile import kind
from clika_runtime.format.metadata import META_DIGEST


def save(model_proto: Any, path: Path, *, external_data: bool) -> Path:
    """Write ``model_proto`` to ``path`` with its content digest first in its metadata; with
    ``external_data``, its floating-point tensors go to a data file beside it (named by content).
    ``model_proto`` is not changed."""
    if path.is_dir():  # the rename into place would fail, naming our temporary file
        raise IsADirectoryError(f"save: {path} is a folder: give a file path, e.g. {path / 'model.onnx'}")
    path = _written_through(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    try:
        if external_data:
            data_name, chunks = _with_external_data(model_proto, path, staged)
        else:
            data_name, chunks = None, _inline(model_proto, str(path))
        _write(staged.with_name(staged.name + ".onnx"), chunks, path)
    finally:
        for leftover in (staged.with_name(staged.name + ".onnx"), staged.with_name(staged.name + ".data")):
            leftover.unlink(missing_ok=True)
    _remove_stale_data(path, keep=data_name)
    return path


def _written_through(path: Path) -> Path:
    """Where ``path`` is saved: the file a symbolic link names (the rename into place would replace
    the link: ``current.onnx`` pointing at a versioned file); ``FileExistsError`` where it names a
    FIFO, a device or a socket, which the rename would replace with a regular file."""
    if path.is_symlink():
        try:
            path = path.resolve(strict=False)
        except RuntimeError:  # Python before 3.13 says a loop so
            raise OSError(f"save: {path} is a symbolic link loop: give the path of a file to write") from None
        if path.is_symlink():  # 3.13 and later return the looping link itself
            raise OSError(f"save: {path} is a symbolic link loop: give the path of a file to write")
    if path.exists() and not path.is_file():
        raise FileExistsError(f"save: {path} is {kind(path)}, not a regular file: give the path of a file to write")
    return path


def _inline(model_proto: Any, where: str) -> list[Any]:
    """The file's bytes: the digest entry, then the model's fields (less any digest it held)."""
    serialized = memoryview(model_proto.SerializeToString())
    found = digest.compute(serialized.obj, None, where)
    return [found.computed.entry_bytes(), *(serialized[a:b] for a, b in found.kept)]


def _with_external_data(model_proto: Any, path: Path, staged: Path) -> tuple[str | None, list[Any]]:
    """Write the data file (into place) and return its name and the model file's bytes; no name
    when the model holds no weights to move."""
    import onnx
    from onnx.external_data_helper import write_external_data_tensors

    copy = onnx.ModelProto()
    copy.CopyFrom(model_proto)  # moving weights out of a proto empties it: work on a copy
    _drop_digest(copy)
    data = staged.with_name(staged.name + ".data")
    _mark_weights_external(copy, data.name)
    write_external_data_tensors(copy, str(path.parent))
    if not data.exists():  # no weights to move out (a softmax): the model alone, as inline
        return None, _inline(copy, str(path))
    _flush(data)
    # Where the bytes are kept is not part of the digest: the data file can be named after it.
    found = digest.compute(copy.SerializeToString(), path.parent, str(path))
    data_name = f"{path.name}.{found.computed.overall[:16]}.data"
    for tensor in _graph_tensors(copy.graph):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == data.name:
                entry.value = data_name
    os.replace(data, path.with_name(data_name))
    return data_name, [found.computed.entry_bytes(), copy.SerializeToString()]


def _drop_digest(proto: Any) -> None:
    kept = [p for p in proto.metadata_props if p.key != META_DIGEST]
    if len(kept) != len(proto.metadata_props):
        del proto.metadata_props[:]
        proto.metadata_props.extend(kept)


def _write(staged: Path, chunks: Iterable[Any], path: Path) -> None:
    with staged.open("wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, path)
    _flush_folder(path.parent)


def _flush(path: Path) -> None:
    """Put a written file on the disk before it is renamed: a crash then leaves the old file or the
    whole new one, not a new name over data not yet written."""
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _flush_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform where folders cannot be opened (Windows): the rename is what matters
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_data(path: Path, keep: str | None) -> None:
    """Data files of earlier saves of ``path`` that the model now in place does not name: ours
    (``<name>.<16 hex>.data``) and the single ``<name>.data`` that versions before 0.2 wrote."""
    ours = re.compile(re.escape(path.name) + r"\.[0-9a-f]{16}\.data")
    for candidate in path.parent.iterdir():
        if candidate.name != keep and (ours.fullmatch(candidate.name) or candidate.name == f"{path.name}.data"):
            candidate.unlink(missing_ok=True)


def _mark_weights_external(proto: Any, location: str) -> None:
    """Mark every floating-point tensor of ``proto`` for ``location``, whatever its size.

    Integer tensors stay inline: onnxruntime needs shape-like constants (a Reshape's shape, a
    ReduceMean's axes) in the model file to infer shapes, and they are never the bulk of a model.
    """
    from onnx import TensorProto
    from onnx.external_data_helper import set_external_data

    inline = {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT8,
              TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL, TensorProto.STRING}
    for tensor in _graph_tensors(proto.graph):
        if tensor.data_type not in inline and tensor.HasField("raw_data"):
            set_external_data(tensor, location)


def _graph_tensors(graph: Any) -> Iterator[Any]:
    """The initializers and constant tensors of ``graph`` and of the graphs nested in its nodes."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _graph_tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _graph_tensors(sub)
