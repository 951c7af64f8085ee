"""Timing for the benchmarks: interleaved rounds of calibrated blocks, and ratios of paired rounds.

This machine is shared and noisy: variants are timed in rounds (each round times every variant
once, in shuffled order), and a ratio is the median over rounds of that round's ratio, so it
compares numbers measured under the same load.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable


def per_call_us(fn: Callable[[], Any], block_s: float) -> Callable[[], float]:
    """Calibrate a block of calls lasting about ``block_s``; return a timer of one block (us per call)."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    n = max(1, int(block_s / once))

    def block() -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    return block


def measure(variants: dict[str, Callable[[], Any]], rounds: int, block_s: float, warmup: int = 20
            ) -> dict[str, list[float]]:
    """Per variant, one us-per-call figure per round (calls of a second or more: ``warmup=1``)."""
    for fn in variants.values():  # warm up every variant before any timing
        for _ in range(warmup):
            fn()
    blocks = {name: per_call_us(fn, block_s) for name, fn in variants.items()}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            samples[name].append(blocks[name]())
    return samples


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b, each pair timed in the same round."""
    return statistics.median(x / y for x, y in zip(a, b))


def median(values: list[float]) -> float:
    """The median."""
    return statistics.median(values)
