"""A graph file's content digest: what it covers, how it is computed from the file's bytes, and its check.

``ModelGraph.save`` records the digest in the metadata entry ``clika_runtime.digest``;
``cr.load``, ``ModelGraph.load`` and ``clika-runtime validate`` compute it again and refuse a file
whose content differs, naming the tensor or the section. It finds a file changed after it was
saved (a flipped bit on a disk or in a copy, a torn write, a data file from another save). It is
not a signature: whoever can write the file can write a digest that matches.

What it covers, computed from the protobuf wire bytes without onnx (``cr.load`` runs where only
onnxruntime and numpy are installed), sha256 throughout:

- **each tensor's data** (initializers, constants in node attributes, in subgraphs and functions,
  sparse tensors' values and indices), one digest per tensor in the order the file holds them:
  its raw bytes wherever they are kept (``raw_data``, or the external file at its offset and
  length), then its typed-data fields (``float_data``, ...) as written;
- **the graph**: the whole model except the digest entry and, for each tensor, its data and where
  it is kept (``raw_data``, the typed-data fields, ``external_data``, ``data_location``). Messages
  on the way to tensors (graph, node, attribute, function, training info, sparse tensor) are hashed
  field by field in file order with each nested one replaced by its own digest (its length
  depends on where its tensors' data is kept); every other field is hashed as its bytes. So names,
  shapes, nodes, opsets and the other metadata (the guard, the trees) are covered as written, and
  one model has one digest whether its weights are inline or in an external file.

The record is JSON: ``{"algorithm": "sha256", "graph": hex, "tensors": [hex, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from clika_runtime.base.errors import GraphFileError
from clika_runtime.format.graphfile import EXTERNAL, LENGTH, MAX_NESTING, PATHS, VARINT, entry, outside, spans, varint
from clika_runtime.format.metadata import MAX_VALUE_BYTES, META_DIGEST

logger = logging.getLogger("clika_runtime")

ALGORITHM = "sha256"
_METADATA_PROPS = 14  # ModelProto.metadata_props
_TENSOR_NAME, _RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION = 8, 9, 13, 14
_TYPED_DATA = frozenset({4, 5, 6, 7, 10, 11})  # float, int32, string, int64, double, uint64 data
_CHUNK = 16 * 2**20
_SHOWN = 16  # hex digits of a digest a message shows
_RECORD_START = f'{{"algorithm":"{ALGORITHM}","graph":"'.encode()  # how every record ``Digest.record`` writes starts


@dataclass(frozen=True)
class Digest:
    """A model's content digest: the graph's and each tensor's, in file order."""

    graph: str
    tensors: tuple[str, ...]
    names: tuple[str, ...] = field(default=(), compare=False)  # the tensors' names, for messages

    @property
    def overall(self) -> str:
        """One digest of the whole: the graph's and every tensor's."""
        return hashlib.sha256((self.graph + "".join(self.tensors)).encode()).hexdigest()

    def record(self) -> str:
        """The metadata entry's value."""
        return json.dumps({"algorithm": ALGORITHM, "graph": self.graph, "tensors": list(self.tensors)},
                          separators=(",", ":"))

    def entry_bytes(self) -> bytes:
        """The metadata entry as a ``ModelProto`` field, to write before the model's other fields
        (protobuf takes fields in any order): a file cut short then never lacks only its digest."""
        message = _length_field(1, META_DIGEST.encode()) + _length_field(2, self.record().encode())
        return _length_field(_METADATA_PROPS, message)


@dataclass(frozen=True)
class Found:
    """A model file's digest as computed, the digest it records (the entry's text, ``None`` when
    it records none), and its bytes without that entry (ranges of the file)."""

    computed: Digest
    recorded: str | None
    kept: tuple[tuple[int, int], ...]
    damaged_key: str | None = None  # where a digest record lies under another key (a flipped bit in ours)


def compute(data: bytes, folder: Path | None, where: str, *, keep: dict | None = None) -> Found:
    """The digest of a serialised model whose external data lies in ``folder`` (``None``: a model
    in memory, which has none). ``keep``, when given, receives each external region's bytes by
    ``(location, offset, length)``, for a caller that places them in the model. ``GraphFileError``
    for bytes that are not well-formed protobuf or external data that cannot be read whole."""
    walk = _Walk(memoryview(data), folder, where, keep)
    try:
        graph = walk.message(0, len(data), "model", 0)
    except GraphFileError:  # a ValueError too, already saying what is wrong
        raise
    except (ValueError, IndexError) as e:
        raise GraphFileError(f"{where}: not a readable ONNX model (truncated or corrupt?): {e}") from None
    finally:
        walk.close()
    kept, pos = [], 0
    for start, end in walk.cut:
        kept.append((pos, start))
        pos = end
    kept.append((pos, len(data)))
    computed = Digest(graph.hex(), tuple(walk.tensors), tuple(walk.names))
    return Found(computed, walk.recorded, tuple((a, b) for a, b in kept if b > a), walk.damaged_key)


def verify(data: bytes, folder: Path | None, where: str, *, keep: dict | None = None) -> Found:
    """``compute``, then ``GraphFileError`` (one line: which tensor or section, expected vs found)
    when the file records a digest its content does not have. A file that records none is
    logged (INFO) and passes: graphs saved before digests load as before."""
    found = compute(data, folder, where, keep=keep)
    if found.recorded is None and found.damaged_key is not None:
        raise GraphFileError(
            f"{where}: its content digest lies under the metadata key {found.damaged_key!r}, not {META_DIGEST!r}: "
            f"the file changed after it was saved (re-save or re-copy it; verify_digest=False / --no-digest skips "
            f"this check)")
    if found.recorded is None:
        logger.info("%s: carries no content digest (saved before clika_runtime wrote digests, or by another tool): "
                    "its content is not checked", where)
        return found
    problem = mismatch(recorded(found.recorded, where), found.computed)
    if problem:
        raise GraphFileError(f"{where}: content digest mismatch: {problem}; the file changed after it was saved "
                             f"(re-save or re-copy it; verify_digest=False / --no-digest skips this check)")
    return found


def recorded(text: str, where: str) -> Digest:
    """The digest a file records, checked for shape; ``GraphFileError`` when malformed."""
    try:
        if len(text) > MAX_VALUE_BYTES:
            raise ValueError(f"{len(text):,} characters, past the {MAX_VALUE_BYTES:,} allowed")
        value = json.loads(text)
        if not isinstance(value, dict) or value.get("algorithm") != ALGORITHM:
            raise ValueError(f"expected an object with algorithm {ALGORITHM!r}")
        graph, tensors = value.get("graph"), value.get("tensors")
        if not _is_hex(graph) or not isinstance(tensors, list) or not all(_is_hex(t) for t in tensors):
            raise ValueError("expected a graph digest and a list of tensor digests, each 64 hex digits")
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise GraphFileError(f"{where}: malformed content digest entry {META_DIGEST!r}: {str(e)[:120]}") from None
    return Digest(graph, tuple(tensors))


def mismatch(expected: Digest, found: Digest) -> str:
    """Where ``found`` differs from ``expected``, in words ("" when it does not)."""
    if len(expected.tensors) != len(found.tensors):
        return (f"graph holds {len(found.tensors)} tensors, the digest was made for {len(expected.tensors)} "
                f"(graph expected {_shown(expected.graph)}, found {_shown(found.graph)})")
    differ = [i for i, (a, b) in enumerate(zip(expected.tensors, found.tensors)) if a != b]
    if differ:
        i = differ[0]
        name = found.names[i] if i < len(found.names) and found.names[i] else f"#{i} (unnamed)"
        more = f" (and {len(differ) - 1} more tensors)" if len(differ) > 1 else ""
        return f"tensor {name!r}: expected {_shown(expected.tensors[i])}, found {_shown(found.tensors[i])}{more}"
    if expected.graph != found.graph:
        return f"graph (nodes, names, shapes, metadata): expected {_shown(expected.graph)}, found {_shown(found.graph)}"
    return ""


def _shown(digest: str) -> str:
    return f"{ALGORITHM} {digest[:_SHOWN]}..."


def _one_bit_from(key: bytes, ours: bytes) -> bool:
    """Whether ``key`` is ``ours`` with one bit flipped (a record a tool copied or renamed on
    purpose, ``parent.digest``, is another key: it loads as a file without a digest)."""
    return len(key) == len(ours) and sum(bin(a ^ b).count("1") for a, b in zip(key, ours)) == 1


def _is_hex(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _length_field(number: int, payload: bytes) -> bytes:
    return _varint_bytes(number << 3 | LENGTH) + _varint_bytes(len(payload)) + payload


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class _Walk:
    """One pass over a serialised model: the graph's digest (``message``'s result), each tensor's
    (``tensors``, ``names``), the digest entry (``recorded``) and where it lies (``cut``)."""

    def __init__(self, data: memoryview, folder: Path | None, where: str, keep: dict | None) -> None:
        self.data, self.folder, self.where, self.keep = data, folder, where, keep
        self.tensors: list[str] = []
        self.names: list[str] = []
        self.recorded: str | None = None
        self.damaged_key: str | None = None  # the key a digest record lies under, where not ours
        self.cut: list[tuple[int, int]] = []
        self._files: dict[str, BinaryIO] = {}
        self._read: dict[str, int] = {}  # bytes read per external file

    def message(self, start: int, end: int, kind: str, depth: int) -> bytes:
        """The digest of one message on the way to tensors (a tensor's own, without its data)."""
        if depth > MAX_NESTING:
            raise ValueError(f"messages nested deeper than {MAX_NESTING}")
        if kind == "tensor":
            return self._tensor(start, end)
        data, paths, digest = self.data, PATHS[kind], hashlib.sha256()
        run = start  # the start of the fields not hashed yet, hashed together as bytes
        for number, wire, field_start, value_start, value_end in spans(data, start, end):
            if wire != LENGTH:
                continue
            if kind == "model" and number == _METADATA_PROPS and self._is_digest(value_start, value_end):
                digest.update(data[run:field_start])
                run = value_end
                self.cut.append((field_start, value_end))
            elif number in paths:
                digest.update(data[run:field_start])
                digest.update(number.to_bytes(4, "little"))
                digest.update(self.message(value_start, value_end, paths[number], depth + 1))
                run = value_end
        digest.update(data[run:end])
        return digest.digest()

    def _is_digest(self, start: int, end: int) -> bool:
        key, value = entry(self.data, start, end)
        if key != META_DIGEST.encode():
            if _one_bit_from(key, META_DIGEST.encode()) and value.startswith(_RECORD_START):  # our key, damaged
                self.damaged_key = key.decode("utf-8", "replace")[:60]
            return False
        if self.recorded is not None:
            raise ValueError(f"two {META_DIGEST} entries")
        self.recorded = value.decode("utf-8", "replace")
        return True

    def _tensor(self, start: int, end: int) -> bytes:
        data, digest, content = self.data, hashlib.sha256(), hashlib.sha256()
        index = len(self.tensors)
        self.tensors.append("")  # this tensor's place, before any tensor it nests (none in ONNX)
        self.names.append("")
        name, external, entries, typed, run = b"", False, {}, [], start
        for number, wire, field_start, value_start, value_end in spans(data, start, end):
            if number == _TENSOR_NAME and wire == LENGTH:
                name = bytes(data[value_start:value_end])
                continue
            if number == _RAW_DATA and wire == LENGTH:
                content.update(data[value_start:value_end])
            elif number in _TYPED_DATA:
                typed.append((field_start, value_end))
            elif number == _EXTERNAL_DATA and wire == LENGTH:
                key, value = entry(data, value_start, value_end)
                entries[key] = value
            elif number == _DATA_LOCATION and wire == VARINT:
                external = varint(data, value_start, value_end)[0] == EXTERNAL
            else:
                continue
            digest.update(data[run:field_start])  # the fields before this one, then past it
            run = value_end
        digest.update(data[run:end])
        self.names[index] = name.decode("utf-8", "replace")[:100]
        if external:
            self._external(content, self.names[index], entries)
        for field_start, value_end in typed:
            content.update(data[field_start:value_end])
        self.tensors[index] = content.hexdigest()
        return digest.digest()

    def _external(self, content: Any, name: str, entries: dict[bytes, bytes]) -> None:
        """Hash (and keep, when asked) a tensor's bytes in its external file."""
        location = os.fsdecode(entries.get(b"location", b""))
        offset, length = entries.get(b"offset"), entries.get(b"length")
        if location not in self._files:
            self._files[location] = _opened(self.folder, location, name, self.where)
        handle = self._files[location]
        start, left = _bounds(handle, offset, length, location, name, self.where)
        # A hostile file could point thousands of tensors at one large region: reading more than
        # the data files hold twice over is refused, not hashed for hours.
        self._read[location] = self._read.get(location, 0) + left
        if self._read[location] > 2 * os.fstat(handle.fileno()).st_size:
            raise GraphFileError(f"{self.where}: tensor '{name}': the tensors read external data {location!r} more "
                                 f"than twice over (overlapping regions): refused")
        handle.seek(start)
        if self.keep is not None:
            chunk = handle.read(left)
            if len(chunk) < left:
                raise _short(self.where, location, name)
            content.update(chunk)
            self.keep[(location, offset, length)] = chunk
            return
        buffer = memoryview(bytearray(min(_CHUNK, left)))
        while left:
            n = handle.readinto(buffer[:min(_CHUNK, left)])
            if not n:
                raise _short(self.where, location, name)
            content.update(buffer[:n])
            left -= n

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()



def region(folder: Path | None, location: str, offset: bytes | None, length: bytes | None, name: str,
           where: str) -> bytes:
    """A tensor's bytes in its external file (``offset`` and ``length`` as the file writes them),
    read whole: ``GraphFileError`` for a location outside ``folder`` or a file too short."""
    with _opened(folder, location, name, where) as handle:
        start, size = _bounds(handle, offset, length, location, name, where)
        handle.seek(start)
        chunk = handle.read(size)
    if len(chunk) < size:
        raise _short(where, location, name)
    return chunk


def _opened(folder: Path | None, location: str, name: str, where: str) -> BinaryIO:
    why = "is not readable: the model is not in a folder" if folder is None else outside(folder, location)
    if why:
        raise GraphFileError(f"{where}: tensor '{name}': external data location {location[:100]!r} {why}")
    try:
        return (folder / location).open("rb")
    except OSError as e:
        raise GraphFileError(f"{where}: tensor '{name}': external data {location!r} unreadable: "
                             f"{e.strerror or e}") from None


def _bounds(handle: BinaryIO, offset: bytes | None, length: bytes | None, location: str, name: str,
            where: str) -> tuple[int, int]:
    """Where a tensor's bytes start in its open external file, and how many there are."""
    size = os.fstat(handle.fileno()).st_size
    start = _number(offset, where, name) or 0
    count = size - start if length is None else _number(length, where, name)
    if start + count > size or count < 0:
        raise GraphFileError(f"{where}: tensor '{name}': external data {location!r} holds {size:,} bytes, the "
                             f"tensor reads {count:,} from byte {start:,} (truncated or corrupt?)")
    return start, count


def _number(text: bytes | None, where: str, name: str) -> int | None:
    """An external data offset or length as written (decimal digits), ``None`` when absent."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise GraphFileError(f"{where}: tensor '{name}': external data offset or length {text[:30]!r} is not a number")
    return int(text)


def _short(where: str, location: str, name: str) -> GraphFileError:
    """A read that came back short: the file shrank while it was read."""
    return GraphFileError(f"{where}: tensor '{name}': external data {location!r} ended while it was read "
                          f"(changed under the reader?)")
