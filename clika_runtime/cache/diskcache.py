"""The on-disk capture cache: a later process finds the graphs an earlier one captured.

Layout under the cache directory (``config.cache_dir``)::

    entries/<capture key>/   model.onnx [model.onnx.data] entry.json [optimized-<machine>.onnx]
    functions/<function key>.json   what drift taught a function (its dynamic axes)
    work/                    folders of live captures and entries being written, each named
                             after its process (``base.owners``): those of dead processes go

Writes are atomic: an entry is written into ``work/`` and renamed into ``entries/`` (a reader
never sees half of one; when two processes write one key, the first rename wins and both end
with a valid entry). ``entry.json``'s modification time is its last use: past
``config.cache_max_bytes`` the least recently used entries go. The directory is created for its
owner only; entries that are symlinks or lead outside it are ignored, and so is anything
truncated, corrupt or unreadable (a debug line each: never an error). A directory that cannot be
written turns the cache off for the process with one warning.

Nothing here runs code from the cache: entries are JSON and ONNX files, and a graph from the cache
serves only after it agrees with the eager result of the call that looked it up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clika_runtime.base.config import config
from clika_runtime.base.owners import owned, remove_abandoned
from clika_runtime.base.saying import say

logger = logging.getLogger("clika_runtime")

SCHEMA = 1
ENTRY = "entry.json"
_MAX_JSON = 2**20  # an entry's description is small; a bigger file is not ours


@dataclass(frozen=True)
class Entry:
    """A cached capture: its folder (the graph's files) and its description."""

    folder: Path
    meta: dict[str, Any]

    @property
    def files(self) -> list[Path]:
        """The graph's files (the model, its external data, optimised models)."""
        return sorted(p for p in self.folder.iterdir() if p.is_file() and p.name != ENTRY)


@dataclass(frozen=True)
class EntryInfo:
    """What ``clika-runtime cache list`` shows of an entry."""

    key: str
    graph_name: str
    inputs: list[str]
    bytes: int
    last_used: float


class DiskCache:
    """One cache directory (see the module docstring)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self._made()
        root.chmod(0o700)
        self._real = root.resolve()
        self.sweep()

    def _made(self) -> None:
        for sub in ("entries", "functions", "work"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)

    def ready(self) -> Path | None:
        """``work``, its folders made again where they were removed since (a cache cleared by
        hand while the process runs), without the folders processes that are gone left there
        (workers a long-lived parent forked: the parent opened the cache, and swept it, once);
        ``None`` when they cannot be made: the cache is turned off."""
        try:
            self._made()
            self.sweep()
        except OSError as e:
            self.refuse(e)
            return None
        return self.work

    def refuse(self, error: BaseException) -> None:
        """Turn this cache off for the process, saying why once."""
        refuse(self.root, error)

    def sweep(self) -> None:
        """Remove the folders in ``work/`` that processes of this host left when they died (a
        server stopped by SIGKILL runs no clean-up): live captures' graphs, entries half written."""
        remove_abandoned(self.work)

    @property
    def work(self) -> Path:
        """Where live captures keep their graph folders (on the cache's filesystem: hard links)."""
        return self.root / "work"

    # ------------------------------------------------------------------------------------ entries

    def load(self, key: str) -> Entry | None:
        """The entry for ``key``, or ``None`` (absent, or not a sound entry: a debug line says why)."""
        folder = self.root / "entries" / key
        try:
            if not folder.is_dir():
                return None
            if folder.is_symlink() or self._real not in folder.resolve().parents:
                logger.debug("disk cache: entry %s leads outside the cache, ignored", key)
                return None
            meta = _read_json(folder / ENTRY)
            if meta.get("schema") != SCHEMA or not (folder / meta.get("model", "")).is_file():
                raise ValueError("not an entry of this version, or its model file is missing")
            sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.name in meta.get("files", {})}
            if sizes != meta.get("files"):
                raise ValueError("its files are not the ones it was written with (truncated?)")
            os.utime(folder / ENTRY)  # its last use, for the eviction order
            return Entry(folder, meta)
        except (OSError, ValueError) as e:
            logger.debug("disk cache: entry %s unusable (%s), ignored", key, e)
            return None

    def save(self, key: str, files: list[Path], meta: dict[str, Any]) -> None:
        """Store the graph files under ``key`` with their description, atomically. An entry larger
        than the whole cache is not stored, and the first such says so (a big model's warm starts
        need a larger ``cache_max_bytes``)."""
        size = sum(path.stat().st_size for path in files)
        if size > self.max_bytes:
            _say_once(("too big", self.root), f"clika_runtime: a capture of {meta.get('graph_name', '?')} needs {size / 2**30:.1f} GiB, more "
                      f"than the capture cache's bound (cr.config.cache_max_bytes = {self.max_bytes / 2**30:.1f} "
                      "GiB): not kept for later processes; raise cache_max_bytes for warm starts")
            return
        staging = Path(tempfile.mkdtemp(prefix=owned("entry"), dir=self.work))
        try:
            for path in files:
                link_or_copy(path, staging / path.name)
            sizes = {path.name: path.stat().st_size for path in files}
            (staging / ENTRY).write_text(json.dumps({**meta, "schema": SCHEMA, "files": sizes}))
            target = self.root / "entries" / key
            if target.is_symlink():
                target.unlink()  # never followed: replaced
            elif target.exists():
                shutil.rmtree(target, ignore_errors=True)  # a stale or corrupt entry: replaced
            os.rename(staging, target)
        except OSError:
            if not (self.root / "entries" / key / ENTRY).is_file():
                raise
            logger.debug("disk cache: another process stored %s first", key)  # its entry is as good
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._evict()

    # ---------------------------------------------------------------------------------- functions

    def knowledge(self, function: str) -> dict[str, Any] | None:
        """What an earlier process learned about a function (its dynamic axes), or ``None``."""
        try:
            return _read_json(self.root / "functions" / f"{function}.json")
        except (OSError, ValueError):
            return None

    def remember(self, function: str, knowledge: dict[str, Any]) -> None:
        """Keep what a function learned for later processes."""
        path = self.root / "functions" / f"{function}.json"
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(knowledge))
        os.replace(temporary, path)

    # ---------------------------------------------------------------------------------- managing

    def entries(self) -> list[EntryInfo]:
        """Every entry, most recently used first."""
        infos = []
        for folder in (self.root / "entries").iterdir():
            try:
                meta = _read_json(folder / ENTRY)
                size = sum(p.stat().st_size for p in folder.iterdir())
                infos.append(EntryInfo(folder.name, str(meta.get("graph_name", "?")), list(meta.get("names", [])),
                                       size, (folder / ENTRY).stat().st_mtime))
            except (OSError, ValueError):
                continue
        return sorted(infos, key=lambda info: -info.last_used)

    def size(self) -> int:
        """Bytes held by entries."""
        return sum(p.stat().st_size for p in (self.root / "entries").rglob("*") if p.is_file())

    def clear(self) -> None:
        """Remove every entry, everything learned, and what dead processes left (``sweep``)."""
        for sub in ("entries", "functions"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        self.sweep()

    def _evict(self) -> None:
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        while entries and total > self.max_bytes:
            oldest = entries.pop()
            shutil.rmtree(self.root / "entries" / oldest.key, ignore_errors=True)
            total -= oldest.bytes
            logger.debug("disk cache: evicted %s (%d bytes)", oldest.key, oldest.bytes)


_caches: dict[tuple[Path, int], DiskCache] = {}
_refused: set[Path] = set()
_said: set[tuple[str, Path]] = set()  # (what, cache root): each kind of warning once per cache


def active() -> DiskCache | None:
    """The cache ``config`` names now, or ``None`` (off, or unusable: said once per directory)."""
    root = config.cache_path()
    if root is None or root in _refused:
        return None
    key = (root, config.cache_max_bytes)
    if key not in _caches:
        try:
            _caches[key] = DiskCache(root, config.cache_max_bytes)
        except OSError as e:
            refuse(root, e)
            return None
    return _caches[key]


def refuse(root: Path, error: BaseException) -> None:
    """Turn the cache at ``root`` off for this process, saying why once."""
    _refused.add(root)
    _say_once(("refused", root),
              f"clika_runtime: the capture cache at {root} cannot be used ({error}); continuing without it")


def _say_once(topic: tuple[str, Path], message: str) -> None:
    if topic not in _said:
        _said.add(topic)
        say(message, 4)  # held where warnings are errors: raised by the call once its work is done


def _read_json(path: Path) -> dict[str, Any]:
    if path.is_symlink():
        raise ValueError("a symlink")
    with path.open("rb") as handle:
        text = handle.read(_MAX_JSON + 1)
    if len(text) > _MAX_JSON:
        raise ValueError("too large")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link of ``source`` at ``target`` (no bytes copied), or a copy where links cannot be."""
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a copy will do
        shutil.copyfile(source, target)
