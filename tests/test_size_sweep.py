"""Graphs agree with eager at sizes they were not verified at. A graph is verified at the sizes it
was captured at; an op whose index arithmetic rounds differently from torch's at other sizes (the
source index of a nearest resize, a pooling window) was served wrong answers there, with no
warning. Each row captures once with its spatial axes dynamic (two calls), then calls the graph
at every size of a range. The full sweep, more ops and sizes, is scripts/size_sweep.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import clika_runtime as cr

_SPEC = importlib.util.spec_from_file_location("size_sweep", Path(__file__).parents[1] / "scripts" / "size_sweep.py")
sweep = sys.modules["size_sweep"] = importlib.util.module_from_spec(_SPEC)  # dataclasses look their module up
_SPEC.loader.exec_module(sweep)

SIZES = range(5, 40)
_CASES = {case.name: case for case in sweep.cases()}

# Each was served wrong at the sizes named before its translation (exporters/translations.py).
FIXED = {
    "nearest-exact 2d scale 0.7": "7, 14, 23, 28",
    "nearest-exact 1d scale 2.3": "16..39, most",
    "nearest-exact 3d scale 0.7": "7, 8, 9, 14, 22, 23, 28",
    "nearest 2d scale 2.3": "31..39",
    "nearest 2d size 2s-1": "21, 39",
    "nearest 1d scale 1.05": "5..19 (2..19: torch's 2-d shortcuts applied to 1-d)",
    "nearest 1d scale 2.05": "5..19",
    "nearest 3d scale 2.05": "5..19",
    "adaptive_avg_pool2d 7": "9..13, 16..20, 23..27, 30..34 (and eager at 9 others)",
    "arange 0, n, 0.7": "7, 14, 28, 35 (its length in float32: exporters/sizes.py)",
}

# Checked and found right: a few of every kind the full sweep covers.
RIGHT = [
    "nearest 2d scale 0.7", "nearest-exact 2d size 7x13", "nearest 2d scale 0.7 recomputed",
    "bilinear scale 0.7 align_corners=False", "bicubic scale 2.3 align_corners=True",
    "trilinear scale 0.7 align_corners=True", "avg_pool2d 3/2 pad 1 ceil=True count_include_pad=False",
    "max_pool2d 3/2 pad 1 ceil=True", "Tensor.unfold 3/2", "F.unfold 3 stride 2 dilation 2 pad 1",
    "nearest 2d scale 2.05",
    "pixel_unshuffle 2", "adaptive_avg_pool2d 3x5", "slice 2:-3:2", "narrow -4, 2", "pad reflect", "conv2d stride 2 dilation 2",
]


@pytest.fixture(autouse=True)
def _no_disk_cache():
    cr.config.cache_dir = None  # each row captures its own graphs (the suite's config is restored after)


def _assert_served_right(name: str) -> None:
    result = sweep.sweep(_CASES[name], SIZES)
    assert not result.error, result.error
    assert not result.wrong, f"{name}: the graph answered other than eager at sizes {list(result.wrong)}"
    assert not result.eager, f"{name}: sizes {list(result.eager)} ran eagerly, not through the graph"


@pytest.mark.parametrize("name", sorted(FIXED))
def test_ops_that_were_served_wrong_agree_at_every_size(name):
    _assert_served_right(name)


# Lengths where ``length * scale`` is just below an integer in double and not in float32, or the
# other way round: the graph's output was one longer (shorter) than eager's, whose length is
# computed in double.
WIDE = (20, 33, 50, 90, 100, 170, 180, 330)
WIDE_FIXED = [f"{mode} wide scale {scale} align_corners={corners}"
              for mode in ("linear", "bilinear", "bicubic", "trilinear") for scale in (0.7, 2.3) for corners in (False, True)]
WIDE_FIXED += ["bilinear wide scale 0.65 align_corners=False", "bicubic wide scale 0.65 align_corners=True"]


@pytest.mark.parametrize("name", WIDE_FIXED)
def test_resizes_by_a_scale_factor_are_as_long_as_eager_at_long_lengths(name):
    result = sweep.sweep(_CASES[name], WIDE)
    assert not result.error, result.error
    assert not result.wrong, f"{name}: the graph answered other than eager at lengths {list(result.wrong)}"
    assert not result.eager, f"{name}: lengths {list(result.eager)} ran eagerly, not through the graph"


@pytest.mark.parametrize("name", RIGHT)
def test_ops_agree_at_every_size(name):
    _assert_served_right(name)


def test_the_issue_repro_row_0_at_size_14():
    f = cr.compile(lambda x: torch.nn.functional.interpolate(x, scale_factor=0.7, mode="nearest-exact"))
    ramp = lambda s: torch.arange(s * s, dtype=torch.float32).reshape(1, 1, s, s)  # noqa: E731
    f(ramp(10))
    f(ramp(12))
    got = f(ramp(14))
    assert f.captures[-1].hits >= 1
    torch.testing.assert_close(got, f.__wrapped__(ramp(14)), rtol=0, atol=0)
    assert got[0, 0, 0, :4].tolist() == [0.0, 2.0, 3.0, 5.0]
