"""Captures reach a steady state: what one export leaves in process-wide registries is bounded.

torch.fx kept the generated source of every GraphModule an export compiles (about 19 an export,
in ``linecache`` and in its loader's ``eval_cache``), and every ``config.patch`` torch entered left
a ContextVar in the caller's context (5 an export): a server that re-captures grew without end.
Counts, not wall time or RSS: the growth per capture was a few dozen objects and ~26 KiB, which
RSS over a short run cannot tell from the allocator settling (docs/BENCHMARKS.md has the RSS run).
"""

from __future__ import annotations

import contextvars
import copyreg
import gc
import linecache
import sys

import onnx
import onnx_ir
import onnxruntime
import pytest
import torch
from torch.fx import graph_module
from torch.utils import _pytree

import clika_runtime as cr

CAPTURES = 10
# Fewer than one capture's worth of any registry that grew (19, 19, 5 and ~60 objects a capture).
MARGIN = 3
OBJECTS_MARGIN = 150

_TRACKED = {
    "GraphModule": torch.fx.GraphModule,
    "ExportedProgram": torch.export.ExportedProgram,
    "onnx_ir.Model": onnx_ir.Model,
    "onnx.ModelProto": onnx.ModelProto,
    "InferenceSession": onnxruntime.InferenceSession,
}


def _registries() -> dict[str, int]:
    """The sizes of what an export could leave behind, process-wide."""
    gc.collect()
    sizes = {name: sum(1 for o in gc.get_objects() if isinstance(o, kind)) for name, kind in _TRACKED.items()}
    sizes.update({
        "linecache": len(linecache.cache),
        "fx sources": len(graph_module._loader.eval_cache),
        "context variables": len(contextvars.copy_context()),
        "modules": len(sys.modules),
        "pytree nodes": len(_pytree.SUPPORTED_NODES),
        "copyreg": len(copyreg.dispatch_table),
        # Counted after the isinstance checks: the first reads `__class__` of lazy objects, which
        # makes a few thousand objects once.
        "objects": len(gc.get_objects()),
    })
    return sizes


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The registries that grew by more than the margin, with their growth."""
    grown = {}
    for name, size in after.items():
        margin = OBJECTS_MARGIN if name == "objects" else MARGIN
        if size - before[name] > margin:
            grown[name] = size - before[name]
    return grown


@pytest.fixture
def no_disk_cache(monkeypatch):
    """Every capture exports: the on-disk cache would restore the second one without the exporter."""
    monkeypatch.setattr(cr.config, "cache_dir", None)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()


@pytest.mark.usefixtures("no_disk_cache")
def test_recaptures_after_reset_leave_registries_bounded():
    f = cr.compile(_net())
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(2):  # first exports fill one-off caches (torchlib registry, fake kernels)
            f.reset()
            f(x)
        before = _registries()
        for _ in range(CAPTURES):
            f.reset()
            f(x)
        after = _registries()
    assert len(f.captures) == 1  # each call did capture
    assert _grown(before, after) == {}, (before, after)


@pytest.mark.usefixtures("no_disk_cache")
def test_evicting_captures_leave_registries_bounded(monkeypatch):
    """Hot/cold traffic: three static values over two cache slots, so every call evicts a capture
    and makes one; the evicted graphs and sessions go with it."""
    monkeypatch.setattr(cr.config, "cache_size", 2)
    monkeypatch.setattr(cr.config, "recapture_limit", 10**6)
    net = _net()
    f = cr.compile(lambda x, scale: net(x) * scale)  # a float is baked: one key per value
    x = torch.randn(2, 8)
    with torch.no_grad():
        for i in range(3):
            f(x, float(i))
        before = _registries()
        for i in range(CAPTURES):
            f(x, float(i % 3))
        after = _registries()
    assert len(f.captures) == 2
    assert f.fallback_reason is None
    assert _grown(before, after) == {}, (before, after)


@pytest.mark.usefixtures("no_disk_cache")
def test_sources_of_graph_modules_made_outside_a_capture_stay():
    """Only the sources an export added are dropped: a GraphModule of the user's keeps its lines."""
    traced = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    name = type(traced).forward.__code__.co_filename
    assert name in linecache.cache
    with torch.no_grad():
        cr.compile(_net())(torch.randn(2, 8))
    assert name in linecache.cache
    assert name in graph_module._loader.eval_cache


def test_trap_a_long_lived_function_keeps_its_most_recent_reasons_not_all(monkeypatch):
    # Each re-capture added its reason to a tuple copied whole: a server hot-swapping weights
    # every minute held every reason since it started, and copied them all at each swap.
    from clika_runtime.function import table

    monkeypatch.setattr(table, "WORDS_KEPT", 3)
    model = torch.nn.Linear(4, 2).eval()
    f = cr.compile(model)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        for scale in range(6):
            model.weight.mul_(1.5)
            f(x)
    assert f.recapture_count == 5 and len(f.recapture_reasons) == 3
    assert all(reason.startswith("weights changed") for reason in f.recapture_reasons)
