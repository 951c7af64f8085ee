"""A captured graph's files in a temporary folder of this process's (``GraphFolder``): where
captures keep their graphs, and where a loaded graph's files are copied to be served.

Nothing here imports torch; onnx is imported where a method needs it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from clika_runtime.base.owners import OWNED, owned, remove_abandoned


# Weights past this many bytes are written as external data: saving then needs no serialized copy
# of them, and onnxruntime reads them from the file.
EXTERNAL_ABOVE = 16 * 2**20


def _remove_if_made_here(path: Path, maker: int) -> None:
    if os.getpid() == maker:
        shutil.rmtree(path, ignore_errors=True)


class GraphFolder:
    """A model written to its own temporary folder (``model.onnx``, and ``model.onnx.data`` when
    its weights are large; ``served.onnx`` beside it when onnxruntime's fused kernels apply;
    ``reduced.onnx`` when the graph serves at reduced precision: capture/reducing.py),
    removed when the last reference to the folder goes. Captures keep their graphs here instead
    of in memory; sessions open the files."""

    MODEL = "model.onnx"
    FUSED = "served.onnx"  # the graph with onnxruntime's fused kernels, when any apply (exporters.fusion)
    REDUCED = "reduced.onnx"  # the graph at reduced precision (int8, fp16), when one was asked for and agrees
    _OPTIMIZED = "optimized-"

    # The sha256 of the files a capture hands out (``handed_out``), where the folder was filled from
    # files stored earlier (the disk cache): what runs is checked against eager, these are not.
    recorded: Mapping[str, str] = MappingProxyType({})

    def __init__(self, parent: str | os.PathLike | None = None) -> None:
        # Named after this process, so that those a dead process left are removed: by a cache's
        # ``work/`` folder there, by the next folder made here in the system's temp folder.
        if parent is None:
            remove_abandoned(Path(tempfile.gettempdir()), OWNED)
        self.path = Path(tempfile.mkdtemp(prefix=owned(OWNED), dir=parent))
        # Removed with its last reference (a TemporaryDirectory would also do it, with a ResourceWarning),
        # by this process only: a forked child ending inherits the finalizer, not the folder.
        self._remove = weakref.finalize(self, _remove_if_made_here, self.path, os.getpid())

    @property
    def model(self) -> Path:
        """The model file."""
        return self.path / self.MODEL

    @classmethod
    def write(cls, model_proto: Any, parent: str | os.PathLike | None = None) -> "GraphFolder":
        """Write ``model_proto`` into a new folder. The proto's weights move to the file when they
        are large: the proto must not be used afterwards."""
        import onnx

        folder = cls(parent)
        large = sum(len(t.raw_data) for t in model_proto.graph.initializer) > EXTERNAL_ABOVE
        if large:
            onnx.save_model(model_proto, str(folder.model), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=f"{cls.MODEL}.data", size_threshold=1024)
        else:
            onnx.save_model(model_proto, str(folder.model))
        return folder

    @property
    def opened(self) -> Path:
        """The graph sessions open: the reduced-precision graph, else the fused graph, else the model."""
        for name in (self.REDUCED, self.FUSED):
            if (self.path / name).is_file():
                return self.path / name
        return self.model

    @property
    def reduced(self) -> Path:
        """Where the reduced-precision graph is (or goes)."""
        return self.path / self.REDUCED

    def optimized(self, machine: str) -> Path:
        """Where onnxruntime's optimised model for ``machine`` (``serving.machine_tag``) is kept."""
        return self.path / f"{self._OPTIMIZED}{hashlib.sha256(machine.encode()).hexdigest()[:16]}.onnx"

    def drop_fused(self) -> bool:
        """Remove the fused graph and what onnxruntime made of it; whether there was one."""
        return self._drop(self.FUSED)

    def drop_reduced(self) -> bool:
        """Remove the reduced-precision graph and what onnxruntime made of it; whether there was one."""
        return self._drop(self.REDUCED)

    def _drop(self, name: str) -> bool:
        graph = self.path / name
        if not graph.is_file():
            return False
        for path in [graph, *self.path.glob(f"{name}.data"), *self.path.glob(f"{self._OPTIMIZED}*")]:
            path.unlink(missing_ok=True)
        return True

    def files(self) -> list[Path]:
        """The files of the model (the model, its external data)."""
        return sorted(p for p in self.path.iterdir() if p.is_file())

    def digests(self) -> dict[str, str]:
        """The sha256 of each file a capture hands out: the model and the reduced-precision graph,
        with their external data."""
        return {p.name: _sha256(p) for p in self.files() if p.name.startswith((self.MODEL, self.REDUCED))}

    def changed_since_stored(self, graph: Path) -> str | None:
        """The first of ``graph``'s files (it and its external data) whose content is not what
        ``recorded`` says, in words; ``None`` when all are (or nothing was recorded)."""
        for path in sorted(self.path.glob(f"{graph.name}*")):
            want = self.recorded.get(path.name)
            if want is not None and _sha256(path) != want:
                return f"{path.name} of {self.path}"
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(2**20):
            digest.update(block)
    return digest.hexdigest()
