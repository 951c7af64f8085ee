"""Size sweep: ops whose index or size arithmetic the exporter writes, each captured once with its
spatial axes dynamic (two calls, so the second drifts), then called at every size of a range and
compared with eager. A graph is verified at the sizes it was captured at; a rounding rule that
differs at other sizes (an interpolation's source index, a pooling window's count) is found only
by calling it there.

Usage: .venv/bin/python scripts/size_sweep.py [--sizes 5 40] [--only SUBSTRING]
(the ``wide`` cases show their trap past 40: ``--only wide --sizes 40 400``)
Exit code 0 only when every case agreed with eager at every size and was served by its graph.
tests/test_size_sweep.py runs a subset of these cases.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import clika_runtime as cr


@dataclass(frozen=True)
class Case:
    """One op: ``fn`` of one tensor whose shape at sweep size ``s`` is ``shape(s)``."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    shape: Callable[[int], tuple[int, ...]]
    exact: bool = True  # index ops: equal to eager bit for bit; arithmetic ops: within tolerance
    captures: tuple[int, int] = (10, 12)  # the sizes of the two capturing calls
    # Long lengths: float32 coordinates drift from the exact answer as they grow, torch's as well
    # as onnxruntime's (both ~1e-4 at 760 positions), so values are judged against float64:
    # within 4x of eager's own float32 error (the lengths are judged exactly).
    float64: bool = False


@dataclass
class Counter:
    """The target as a callable object: counts the calls that ran eagerly."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    calls: int = field(default=0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fn(x)


@dataclass(frozen=True)
class Result:
    name: str
    wrong: tuple[int, ...]  # sizes the compiled function returned something else than eager at
    eager: tuple[int, ...]  # sweep sizes that ran eagerly instead of through a graph
    error: str = ""


def ramp(shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct values, so an index off by one shows; small enough to be exact in float32."""
    count = 1
    for size in shape:
        count *= size
    return (torch.arange(count, dtype=torch.float32) % 251).reshape(shape) / 8


def noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _image(s: int) -> tuple[int, ...]:
    return (1, 2, s, s)


def _line(s: int) -> tuple[int, ...]:
    return (1, 2, s)


def _volume(s: int) -> tuple[int, ...]:
    return (1, 1, s, s, s // 2 + 3)


def _wide(rank: int) -> Callable[[int], tuple[int, ...]]:
    """A spatial shape of ``rank`` whose last axis is the sweep size: long lengths, few elements."""
    return lambda s: (1, 2) + (3,) * (rank - 1) + (s,)


def _resize(mode: str, **options) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.interpolate(x, mode=mode, **options)


def _resize_cases() -> list[Case]:
    cases = []
    scales = (0.7, 0.5, 1 / 3, 1.5, 2, 2.3)
    for mode in ("nearest", "nearest-exact"):
        for scale in scales:
            cases.append(Case(f"{mode} 2d scale {scale:.3g}", _resize(mode, scale_factor=scale), _image))
            cases.append(Case(f"{mode} 1d scale {scale:.3g}", _resize(mode, scale_factor=scale), _line))
        cases.append(Case(f"{mode} 3d scale 0.7", _resize(mode, scale_factor=0.7), _volume))
        for scale in (1.05, 2.05):  # out == in and out == 2 * in at short lengths: 2-d's shortcuts only
            cases.append(Case(f"{mode} 1d scale {scale:.3g}", _resize(mode, scale_factor=scale), _line))
            cases.append(Case(f"{mode} 2d scale {scale:.3g}", _resize(mode, scale_factor=scale), _image))
        cases.append(Case(f"{mode} 3d scale 2.05", _resize(mode, scale_factor=2.05), _volume))
        cases.append(Case(f"{mode} 2d scale 0.7 recomputed",
                          _resize(mode, scale_factor=0.7, recompute_scale_factor=True), _image))
        cases.append(Case(f"{mode} 2d size 7x13", _resize(mode, size=(7, 13)), _image))
        cases.append(Case(f"{mode} 2d size 2s-1", lambda x, m=mode: F.interpolate(
            x, size=(2 * x.shape[-2] - 1, x.shape[-1] + 3), mode=m), _image))
    for mode, shape in (("bilinear", _image), ("bicubic", _image), ("linear", _line), ("trilinear", _volume)):
        for corners in (False, True):
            for scale in (0.7, 2, 2.3):
                cases.append(Case(f"{mode} scale {scale} align_corners={corners}",
                                  _resize(mode, scale_factor=scale, align_corners=corners), shape, exact=False,
                                  float64=True))
            cases.append(Case(f"{mode} size 7x13 align_corners={corners}",
                              _resize(mode, size=(7, 13, 9)[:len(shape(5)) - 2], align_corners=corners),
                              shape, exact=False, float64=True))
        cases.append(Case(f"{mode} scale 0.7 recomputed", _resize(mode, scale_factor=0.7, recompute_scale_factor=True),
                          shape, exact=False, float64=True))
    for mode, rank in (("linear", 1), ("bilinear", 2), ("bicubic", 2), ("trilinear", 3)):
        # Lengths where ``length * scale`` in double is just below an integer but not in float32
        # (0.7 at 90, 170; 2.3 at 50, 90, 100), or is one and not in float32 (0.65 at 180, 340).
        for scale in (0.7, 2.3, 0.65):
            for corners in (False, True):
                cases.append(Case(f"{mode} wide scale {scale} align_corners={corners}",
                                  _resize(mode, scale_factor=scale, align_corners=corners), _wide(rank), exact=False,
                                  float64=True))
    for mode in ("bilinear", "bicubic"):
        for scale in (0.7, 0.4):
            cases.append(Case(f"{mode} antialias scale {scale}",
                              _resize(mode, scale_factor=scale, antialias=True), _image, exact=False))
    return cases


def _pool_cases() -> list[Case]:
    cases = [
        Case("adaptive_avg_pool1d 5", lambda x: F.adaptive_avg_pool1d(x, 5), _line, exact=False),
        Case("adaptive_avg_pool2d 3x5", lambda x: F.adaptive_avg_pool2d(x, (3, 5)), _image, exact=False),
        Case("adaptive_avg_pool2d 7", lambda x: F.adaptive_avg_pool2d(x, 7), _image, exact=False),
        Case("adaptive_max_pool2d 3x5", lambda x: F.adaptive_max_pool2d(x, (3, 5)), _image),
        Case("adaptive_max_pool1d 4", lambda x: F.adaptive_max_pool1d(x, 4), _line),
    ]
    for ceil in (False, True):
        for include in (False, True):
            cases.append(Case(f"avg_pool2d 3/2 pad 1 ceil={ceil} count_include_pad={include}",
                              lambda x, c=ceil, i=include: F.avg_pool2d(x, 3, 2, 1, ceil_mode=c, count_include_pad=i),
                              _image, exact=False))
        cases.append(Case(f"avg_pool2d 2/2 ceil={ceil}", lambda x, c=ceil: F.avg_pool2d(x, 2, ceil_mode=c),
                          _image, exact=False))
        cases.append(Case(f"avg_pool1d 3/2 pad 1 ceil={ceil}",
                          lambda x, c=ceil: F.avg_pool1d(x, 3, 2, 1, ceil_mode=c, count_include_pad=False),
                          _line, exact=False))
        cases.append(Case(f"max_pool2d 3/2 pad 1 ceil={ceil}",
                          lambda x, c=ceil: F.max_pool2d(x, 3, 2, 1, ceil_mode=c), _image))
        cases.append(Case(f"max_pool2d 2/2 ceil={ceil}", lambda x, c=ceil: F.max_pool2d(x, 2, ceil_mode=c), _image))
        cases.append(Case(f"max_pool2d 3/2 dilation 2 ceil={ceil}",
                          lambda x, c=ceil: F.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=c), _image))
        cases.append(Case(f"max_pool1d 3/2 pad 1 ceil={ceil}",
                          lambda x, c=ceil: F.max_pool1d(x, 3, 2, 1, ceil_mode=c), _line))
    return cases


def _shape_cases() -> list[Case]:
    conv = torch.nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=2).eval()
    conv_t = torch.nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1).eval()
    conv1 = torch.nn.Conv1d(2, 3, 4, stride=3, padding=2).eval()
    return [
        Case("Tensor.unfold 3/2", lambda x: x.unfold(-1, 3, 2), _image),
        Case("Tensor.unfold 4/3 dim -2", lambda x: x.unfold(-2, 4, 3), _image),
        Case("F.unfold 3 stride 2 dilation 2 pad 1", lambda x: F.unfold(x, 3, dilation=2, padding=1, stride=2),
             _image),
        Case("F.fold of F.unfold", lambda x: F.fold(F.unfold(x, 2, stride=2), x.shape[-2:], 2, stride=2), _image),
        Case("pixel_shuffle 2", lambda x: F.pixel_shuffle(x, 2), lambda s: (1, 8, s, s + 1)),
        Case("pixel_unshuffle 2", lambda x: F.pixel_unshuffle(x, 2), lambda s: (1, 2, 2 * s, 2 * s + 4)),
        Case("slice ::3", lambda x: x[..., ::3], _image),
        Case("slice 1::2", lambda x: x[..., 1::2], _image),
        Case("slice 2:-3:2", lambda x: x[..., 2:-3:2], _image),
        Case("slice -5:", lambda x: x[..., -5:], _image),
        Case("slice :-2, -4::3", lambda x: x[..., :-2, -4::3], _image),
        Case("flip", lambda x: x.flip(-1), _image),
        Case("flip two axes", lambda x: x.flip(-1, -2), _image),
        Case("narrow 2, 3", lambda x: torch.narrow(x, -1, 2, 3), _image),
        Case("narrow -4, 2", lambda x: torch.narrow(x, -1, -4, 2), _image),
        Case("narrow to the end", lambda x: torch.narrow(x, -1, 1, x.shape[-1] - 2), _image),
        Case("roll", lambda x: torch.roll(x, 3, -1), _image),
        Case("pad reflect", lambda x: F.pad(x, (2, 3, 1, 4), mode="reflect"), _image),
        Case("pad replicate", lambda x: F.pad(x, (2, 3, 1, 4), mode="replicate"), _image),
        Case("pad circular", lambda x: F.pad(x, (2, 3, 1, 4), mode="circular"), _image),
        Case("pad constant negative", lambda x: F.pad(x, (-1, 2, 3, -2)), _image),
        Case("pad reflect 1d", lambda x: F.pad(x, (4, 1), mode="reflect"), _line),
        Case("arange 0, n, 0.7", lambda x: torch.arange(0, x.shape[-1], 0.7) + x.sum(), _line, exact=False),
        Case("arange n * 0.7", lambda x: torch.arange(x.shape[-1] * 0.7) + x.sum(), _line, exact=False),
        Case("arange 0.3, n, 0.1", lambda x: torch.arange(0.3, x.shape[-1], 0.1) + x.sum(), _line, exact=False),
        Case("conv2d stride 2 dilation 2", conv, _image, exact=False),
        Case("conv_transpose2d stride 2", conv_t, _image, exact=False),
        Case("conv1d stride 3 pad 2", conv1, _line, exact=False),
    ]


def cases() -> list[Case]:
    return _resize_cases() + _pool_cases() + _shape_cases()


def _agrees(case: Case, x: torch.Tensor, got: torch.Tensor) -> bool:
    expected = case.fn(x)
    if got.shape != expected.shape:
        return False
    if case.exact:
        return torch.equal(got, expected)
    if torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        return True
    if not case.float64:
        return False
    truth = case.fn(x.double())
    return bool((got.double() - truth).abs().max() <= 4 * (expected.double() - truth).abs().max())


def _input(case: Case, size: int) -> torch.Tensor:
    return ramp(case.shape(size)) if case.exact else noise(case.shape(size), size)


def sweep(case: Case, sizes: range) -> Result:
    """Capture ``case`` dynamic (two calls), then call it at every size and compare with eager."""
    target = Counter(case.fn)
    f = cr.compile(target)
    wrong, eager = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for size in case.captures:
            f(_input(case, size))
        if f.state is not cr.CompiledFunction.State.Compiled:
            return Result(case.name, (), tuple(sizes), f"not compiled: {f.state}")
        for size in sizes:
            x = _input(case, size)
            before = target.calls
            got = f(x)
            if target.calls != before:
                eager.append(size)
            if not _agrees(case, x, got):
                wrong.append(size)
    return Result(case.name, tuple(wrong), tuple(eager))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs=2, type=int, default=(5, 40), metavar=("FIRST", "END"))
    parser.add_argument("--only", default="", help="run the cases whose name holds this")
    options = parser.parse_args()
    torch.set_num_threads(1)
    cr.config.cache_dir = None  # every case captures its own graphs: no entry of another case serves it
    failed = 0
    for case in cases():
        if options.only not in case.name:
            continue
        result = sweep(case, range(*options.sizes))
        ok = not (result.wrong or result.eager or result.error)
        failed += not ok
        detail = f"wrong at {list(result.wrong)}" if result.wrong else ""
        if result.eager:
            detail += f" eager at {list(result.eager)}"
        print(f"{'ok  ' if ok else 'FAIL'} {case.name} {detail}{result.error}", flush=True)
    print(f"{failed} case(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
