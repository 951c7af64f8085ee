"""What an ONNX file makes its reader read or run besides itself, found without onnx, and the rule
that refuses a file reaching outside its folder.

A graph file is untrusted. A tensor may keep its data in another file, named by its
``external_data`` ``location``, which the runtime opening the model reads: onnxruntime before 1.24
reads an absolute path, a ``..`` path or a link out of the model's folder as readily as a file
beside it (onnx refuses them since 1.16). A node may also be a provider's precompiled engine
(``EPContext``) or a call into Python (``PyOp``, ``PythonOp``): code, not a portable graph.
``check`` refuses such a file before anything opens it.

The protobuf wire format is read here, because ``cr.load`` runs where only onnxruntime and numpy
are installed, and onnxruntime says nothing about a model's external data. Only the fields on the
way to a tensor's external data or a node's op type are decoded; everything else (weights
included) is skipped by its length. The file is read once into memory, not mapped: a map faults
(SIGBUS, a dead process) when another process truncates the file under it, where a read sees a
short file and the parse refuses it with ``GraphFileError``. The bytes read are the bytes checked,
digested (digest.py) and opened.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Any, Iterator

from clika_runtime.base.errors import GraphFileError

# Ops whose node runs code that is not in the ONNX standard's sense a graph: a provider's compiled
# engine (inline or from a file beside the model) or a Python callable named by the node. Standard
# onnxruntime builds register none of the Python ones; they are refused anyway, for builds that do.
CODE_OPS = frozenset({"EPContext", "PyOp", "PythonOp", "PythonOpGrad"})
MAX_NESTING = 100  # protobuf's own default recursion limit: onnxruntime refuses deeper models too

# Message -> {field number: message that field holds}, from onnx.proto: only the paths that lead
# to a TensorProto or a NodeProto's op type. A "tensor" is read by its own function.
PATHS: dict[str, dict[int, str]] = {
    "model": {7: "graph", 20: "training", 25: "function"},  # ModelProto
    "training": {1: "graph", 2: "graph"},  # TrainingInfoProto: initialization, algorithm
    "function": {7: "node", 11: "attribute"},  # FunctionProto: node, attribute_proto (defaults)
    "graph": {1: "node", 5: "tensor", 15: "sparse"},  # GraphProto: node, initializer, sparse_initializer
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "node": {5: "attribute"},  # NodeProto: attribute
    "sparse": {1: "tensor", 2: "tensor"},  # SparseTensorProto: values, indices
}
VARINT, FIXED64, LENGTH, GROUP_START, GROUP_END, FIXED32 = range(6)
EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


@dataclass(frozen=True)
class Reference:
    """A tensor whose data lies in another file."""

    tensor: str
    location: str  # as written in the file ("" when the tensor is external but names no file)


@dataclass(frozen=True)
class Contents:
    """What a model file reaches besides itself."""

    references: tuple[Reference, ...]
    code_nodes: tuple[str, ...]  # "op_type 'name'" of each node of an op in CODE_OPS


@dataclass(frozen=True)
class Checked:
    """A model file's bytes, as read once and checked."""

    data: bytes
    contents: Contents


def check(path: str | os.PathLike) -> Checked:
    """``GraphFileError`` unless every tensor of the model at ``path`` keeps its data in the file
    itself or in a regular file inside the file's folder, and no node runs code (``CODE_OPS``);
    else the bytes checked, for the caller to use instead of reading the file again."""
    path = Path(path)
    data = read_bytes(path)
    contents = scan(memoryview(data), str(path))
    # The folder as the runtime sees it: the parent of the path it is given, links not followed.
    folder = path.absolute().parent
    problems = [f"tensor '{r.tensor}': external data location {_shown(r.location)} {why}"
                for r in contents.references if (why := outside(folder, r.location))]
    _refuse(str(path), [_code_problem(n) for n in contents.code_nodes] + problems)
    return Checked(data, contents)


def read_bytes(path: Path) -> bytes:
    """The whole file, or ``GraphFileError`` naming it when it cannot be read or is empty."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GraphFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    if not data:
        raise GraphFileError(f"{path}: empty file, not an ONNX model")
    return data


def check_serialized(model: bytes, where: str) -> None:
    """``GraphFileError`` unless a serialised model holds all its data and no node runs code: a
    model in memory has no folder its references could be resolved against."""
    contents = scan(memoryview(model), where)
    problems = [f"tensor '{r.tensor}': data left in the external file {_shown(r.location)}, not in the model: "
                f"load it with ModelGraph.load(path), which reads its external data" for r in contents.references]
    _refuse(where, [_code_problem(n) for n in contents.code_nodes] + problems)


def _refuse(where: str, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise GraphFileError(f"{where}: {'; '.join(problems[:3])}{more}")


def _shown(location: str) -> str:
    """A location as an error shows it: the file decides its length, the message does not."""
    return repr(location) if len(location) <= 100 else f"{location[:100]!r}..."


def _code_problem(node: str) -> str:
    return (f"node {node} runs code that is not part of a portable ONNX graph (a provider's compiled engine or "
            f"a Python call): refused")


def outside(folder: Path, location: str) -> str | None:
    """Why reading ``location`` for a model in ``folder`` would read something other than a regular
    file inside that folder, or ``None`` when it would not."""
    if not location:
        return "is empty: it names no file"
    if "\0" in location:  # the runtime's C++ would read the name up to it; Python refuses it
        return "holds a NUL character"
    if escapes(location):
        return "is absolute or climbs out of the model's folder ('..')"
    try:
        target = (folder / location).resolve()
        if not target.is_relative_to(folder.resolve()):
            return "links out of the model's folder"
        mode = target.stat().st_mode
    except FileNotFoundError:
        return f"names no file in {folder}"
    except (OSError, RuntimeError) as e:  # a link loop (RuntimeError before Python 3.13), a name too long
        return f"cannot be resolved: {getattr(e, 'strerror', None) or e}"
    if not stat.S_ISREG(mode):  # a folder, a FIFO that would block the reader, a device
        return "is not a regular file"
    return None


def escapes(location: str) -> bool:
    """Absolute (POSIX or Windows form) or with a ``..`` part: it could name a file anywhere."""
    path = PureWindowsPath(location)  # splits on both '/' and '\\'
    return bool(path.drive or path.root) or ".." in path.parts


def scan(data: memoryview, where: str) -> Contents:
    """The external references and code nodes of a serialised ``ModelProto``; ``GraphFileError``
    when the bytes are not well-formed protobuf."""
    references: list[Reference] = []
    code_nodes: list[str] = []
    try:
        _message(data, 0, len(data), "model", 0, references, code_nodes)
    except (ValueError, IndexError) as e:
        raise GraphFileError(f"{where}: not a readable ONNX model (truncated or corrupt?): {e}") from None
    return Contents(tuple(references), tuple(code_nodes))


def _message(data: memoryview, start: int, end: int, kind: str, depth: int,
             references: list[Reference], code_nodes: list[str]) -> None:
    if depth > MAX_NESTING:
        raise ValueError(f"messages nested deeper than {MAX_NESTING}")
    if kind == "tensor":
        _tensor(data, start, end, references)
        return
    paths = PATHS[kind]
    name = op_type = b""
    for number, wire, value_start, value_end in _fields(data, start, end):
        if wire != LENGTH:  # a known field number with another wire type is an unknown field to protobuf
            continue
        if kind == "node" and number == 3:
            name = bytes(data[value_start:value_end])
        elif kind == "node" and number == 4:
            op_type = bytes(data[value_start:value_end])
        elif number in paths:
            _message(data, value_start, value_end, paths[number], depth + 1, references, code_nodes)
    if op_type.decode("utf-8", "replace") in CODE_OPS:
        code_nodes.append(f"{op_type.decode()} {name.decode('utf-8', 'replace')[:80]!r}")


def _tensor(data: memoryview, start: int, end: int, references: list[Reference]) -> None:
    name, location, external, entries = b"", None, False, False
    for number, wire, value_start, value_end in _fields(data, start, end):
        if number == 8 and wire == LENGTH:  # name
            name = bytes(data[value_start:value_end])
        elif number == 13 and wire == LENGTH:  # external_data: StringStringEntryProto
            entries = True
            key, value = entry(data, value_start, value_end)
            if key == b"location":
                location = value
        elif number == 14 and wire == VARINT:  # data_location
            external = value_start == EXTERNAL
    if external or entries:
        # os.fsdecode: the path exactly as the runtime would open it, undecodable bytes included
        references.append(Reference(name.decode("utf-8", "replace")[:100], os.fsdecode(location or b"")))


def entry(data: memoryview, start: int, end: int) -> tuple[bytes, bytes]:
    """The key and value of a ``StringStringEntryProto`` (metadata, external data) in ``data[start:end]``."""
    found = {1: b"", 2: b""}
    for number, wire, value_start, value_end in _fields(data, start, end):
        if number in found and wire == LENGTH:
            found[number] = bytes(data[value_start:value_end])
    return found[1], found[2]


def _fields(data: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each field in ``data[start:end]``; for
    a varint, its value and the position after it instead."""
    for number, wire, _, value_start, value_end in spans(data, start, end):
        if wire == VARINT:
            yield number, wire, varint(data, value_start, value_end)[0], value_end
        else:
            yield number, wire, value_start, value_end


def spans(data: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) of each field in
    ``data[start:end]``: the field's bytes are ``data[field start:value end]``, its value's (a
    varint's own bytes, a length-delimited field's payload) ``data[value start:value end]``."""
    pos = start
    while pos < end:
        field_start = pos
        tag, pos = varint(data, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise ValueError(f"field number 0 at byte {pos}")
        if wire == VARINT:
            value_end = varint(data, pos, end)[1]
        elif wire == LENGTH:
            length, pos = varint(data, pos, end)
            value_end = pos + length
        elif wire in (FIXED64, FIXED32):
            value_end = pos + (8 if wire == FIXED64 else 4)
        elif wire == GROUP_START:  # deprecated groups may still appear as unknown fields
            value_end = _group_end(data, pos, end, number)
        else:
            raise ValueError(f"wire type {wire} at byte {pos}")
        if value_end > end:
            raise ValueError(f"field {number} runs past its message at byte {pos}")
        yield number, wire, field_start, pos, value_end
        pos = value_end


def _group_end(data: memoryview, pos: int, end: int, number: int) -> int:
    """The position after the end tag of the group ``number`` that starts at ``pos``."""
    depth = 0
    while pos < end:
        tag, pos = varint(data, pos, end)
        wire = tag & 7
        if wire == GROUP_END:
            if depth == 0:
                if tag >> 3 != number:
                    raise ValueError(f"group {number} ends with the tag of field {tag >> 3}")
                return pos
            depth -= 1
        elif wire == GROUP_START:
            depth += 1
            if depth > MAX_NESTING:
                raise ValueError(f"groups nested deeper than {MAX_NESTING}")
        elif wire == VARINT:
            pos = varint(data, pos, end)[1]
        elif wire == LENGTH:
            length, pos = varint(data, pos, end)
            pos += length
        elif wire in (FIXED64, FIXED32):
            pos += 8 if wire == FIXED64 else 4
        else:
            raise ValueError(f"wire type {wire} at byte {pos}")
    raise ValueError(f"group {number} has no end")


def varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    result = shift = 0
    while pos < end and shift < 70:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise ValueError(f"truncated or overlong varint at byte {pos}")


# Protobuf cannot serialise a message past 2 GiB: past this many bytes of weights (a margin left
# for the rest of the model) they go to an external file, for saving and for opening sessions.
_PROTOBUF_LIMIT = 2**31 - 2**26


def too_big(model_proto: Any) -> bool:
    """Whether the model's weights are past what protobuf can serialise in one message."""
    return sum(len(t.raw_data) for t in model_proto.graph.initializer) > _PROTOBUF_LIMIT


def existing(path: str | os.PathLike, *, folders: bool = False) -> Path:
    """``path`` as a ``Path`` (a symbolic link as the file it names), or ``GraphFileError`` when no
    such file exists or it is no regular file (with ``folders``, a folder will do: a Triton model
    folder)."""
    path = Path(path)
    if not path.exists():
        raise GraphFileError(f"{path}: no such file")
    if not (path.is_file() or folders and path.is_dir()):  # a device or FIFO: "no such file" would mislead
        raise GraphFileError(f"{path}: not a regular file ({kind(path)}), not an ONNX graph")
    # The file a link names: its external data lies beside it (``save`` writes through a link).
    return path.resolve() if path.is_symlink() else path


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def kind(path: Path) -> str:
    """What ``path`` is, in words ("a folder", "a character device"), for errors that say what they found."""
    mode = path.stat().st_mode
    return next((words for test, words in _KINDS if test(mode)), "a special file")


def read_checked(path: str | os.PathLike) -> tuple[Path, Any]:
    """A graph file checked as untrusted bytes (``check``), then parsed without its external data:
    the path and the ``onnx.ModelProto``; ``GraphFileError`` for a file that is missing, reaches
    outside its folder, or is not a readable model."""
    path = existing(path)
    return path, parsed(check(path).data, path)


def parsed(data: bytes, path: Path) -> Any:
    """The ``onnx.ModelProto`` of a model file's bytes (its external data not read)."""
    import onnx

    try:
        return onnx.load_model_from_string(data)
    except Exception as e:
        raise GraphFileError(f"{path}: not a readable ONNX model (truncated or corrupt?): {e}") from e
