"""Shared pieces of the test suite: real torch, real onnxruntime, small models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

import clika_runtime as cr

# The suite's on-disk capture cache: a fresh directory per run, never the user's (subprocesses
# inherit it through the environment), removed when the process that made it ends (not by a
# forked child: those inherit the exit hook).
_CACHE = tempfile.mkdtemp(prefix="clika_runtime_tests_cache_")
os.environ["CLIKA_RUNTIME_CACHE_DIR"] = _CACHE


def _remove_cache(maker: int) -> None:
    if os.getpid() == maker:
        shutil.rmtree(_CACHE, ignore_errors=True)


atexit.register(_remove_cache, os.getpid())


class Counted:
    """Wraps a function and counts the eager calls that reach it."""

    def __init__(self, fn):
        self.fn = fn
        self.__wrapped__ = fn  # keeps the target's signature visible (inspect.signature follows it)
        self.calls = 0
        self.__name__ = getattr(fn, "__name__", "counted")

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


class TinyNet(torch.nn.Module):
    """Linear + GELU over the last axis: any batch and sequence length."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.nn.functional.gelu(self.proj(x))
        return y if mask is None else y * mask[..., None]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory):
    """Each test its own on-disk capture cache: a graph cached by one test never serves another."""
    cr.config.cache_dir = tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _restore_config():
    saved = (cr.config.cache_size, cr.config.recapture_limit, dict(cr.config.tolerances), cr.config.intra_op_threads,
             cr.config.cache_dir, cr.config.cache_max_bytes, cr.config.agreement)
    yield
    (cr.config.cache_size, cr.config.recapture_limit, cr.config.tolerances, cr.config.intra_op_threads,
     cr.config.cache_dir, cr.config.cache_max_bytes, cr.config.agreement) = saved


def current(f):
    """The capture a compiled function most recently created or served (test introspection)."""
    return f._lifecycle.table.current()


def flat_hit(f):
    """The flat hit the function's table holds (None when calls take the general path)."""
    return f._lifecycle.table.flat


def eager_and_served(f, *args, **kwargs):
    """Call a compiled function; return its result and the eager result of its target."""
    with torch.no_grad():
        return f(*args, **kwargs), f.__wrapped__(*args, **kwargs)
