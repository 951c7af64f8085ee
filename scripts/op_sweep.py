"""Op sweep: every op of torch's OpInfo database, compiled and called three times, against eager.

For each op in ``torch.testing._internal.common_methods_invocations.op_db`` that takes float32 on
CPU, the first sample of ``op.sample_inputs("cpu", torch.float32)`` is called through
``cr.compile(lambda *a, **k: op(*a, **k))`` three times under ``torch.no_grad()`` and compared
with the eager call (both seeded, so random ops compare too). Each op lands in one class:

  served        a graph served at least one call, and every call equals eager
  eager         every call equals eager, none served by a graph (fallback reason / warning kept)
  both-raise    eager raises, and so does the compiled function, with the same exception type
  BUG-raise     the compiled function raised where eager did not (or raised another type)
  BUG-differs   a call returned something other than eager
  skipped       no float32 sample, an eager call slower than --slow seconds, or eager differs
                from itself (nondeterministic), or past --timeout seconds for the three calls

With ``--extreme``, a fourth call follows on the same sample with every float tensor's values
replaced by a fixed mix of large, small and signed values (``EXTREMES``: logits of -20, sums of
exponentials past float32's range, -0.0), each tensor at another offset in the mix so that two
inputs meet different values. The graph was verified at the sample's values only: a translation
that is exact there and not at these (``log(sigmoid(x))`` for ``logsigmoid``) is a BUG-differs.

    .venv/bin/python scripts/op_sweep.py --limit 200          # counts, then the bugs
    .venv/bin/python scripts/op_sweep.py --only cumsum -v     # one op, with its reasons
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import torch

import clika_runtime as cr

SERVED, EAGER, BOTH_RAISE, BUG_RAISE, BUG_DIFF, SKIPPED = "served", "eager", "both-raise", "BUG-raise", "BUG-differs", "skipped"


class TimeBox(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise TimeBox()


def same(a: Any, b: Any, scaled: bool = False) -> str | None:
    """None when ``a`` (served) equals ``b`` (eager), else what differs; ``scaled``: the absolute
    tolerance grows with each eager tensor's largest finite magnitude (sums of values in the
    thousands round off by more than 1e-4 in float32)."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            return f"type {type(a).__name__}, eager Tensor"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype} {tuple(a.shape)}, eager {b.dtype} {tuple(b.shape)}"
        if b.is_sparse or b.layout != torch.strided:
            return None if a.layout == b.layout else f"layout {a.layout}, eager {b.layout}"
        atol = 1e-4
        if scaled and b.is_floating_point() and b.numel():
            finite = b[torch.isfinite(b)]
            atol *= max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        try:
            torch.testing.assert_close(a, b, equal_nan=True, atol=atol, rtol=1e-4)
        except AssertionError as error:
            return str(error).splitlines()[0] + " " + " ".join(str(error).splitlines()[1:3])
        return None
    if type(a) is not type(b):
        return f"type {type(a).__name__}, eager {type(b).__name__}"
    if isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)}, eager {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = same(x, y, scaled)
            if why:
                return f"[{i}] {why}"
        return None
    if isinstance(b, dict):
        if list(a) != list(b):
            return f"keys {list(a)}, eager {list(b)}"
        for k in b:
            why = same(a[k], b[k], scaled)
            if why:
                return f"[{k!r}] {why}"
        return None
    if isinstance(b, float) and math.isnan(b):
        return None if isinstance(a, float) and math.isnan(a) else f"{a!r}, eager nan"
    return None if a == b else f"{a!r}, eager {b!r}"


def _innermost(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/clika_runtime/" in f.filename or "/exporters/" in f.filename]
    if not frames:
        return "(no clika_runtime frame)"
    f = frames[-1]
    return f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} in {f.name}"


# Values a translation that is exact at ordinary ones may get wrong: exponentials past float32's
# range (|x| > 88), sigmoids that round to 0 or 1 (|x| >= 17), tiny magnitudes and signed zeros.
EXTREMES = (-1000.0, -100.0, -30.0, -20.0, -17.0, -5.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 5.0, 17.0, 20.0, 30.0,
            100.0, 1000.0)


def _call(fn, sample, extreme: bool = False):
    """One call on a copy of the sample's tensors (in-place ops write their input), seeded;
    ``extreme``: float tensors filled from ``EXTREMES``, each at another offset."""
    offsets = iter(range(10**6))

    def fresh(t):
        if not isinstance(t, torch.Tensor):
            return t
        if not (extreme and t.is_floating_point() and t.numel()):
            return t.clone()
        picks = (torch.arange(t.numel()) + next(offsets)) % len(EXTREMES)
        return torch.tensor(EXTREMES, dtype=t.dtype)[picks].reshape(t.shape)

    inp, args, kwargs = torch.utils._pytree.tree_map(fresh, (sample.input, sample.args, sample.kwargs))
    torch.manual_seed(0)
    return fn(inp, *args, **kwargs)


# Ops whose values are whatever memory held: two eager calls usually differ (skipped as
# nondeterministic), but not always.
UNSPECIFIED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"})


def sweep_one(op: Any, slow: float = 1.0, timeout: float = 60.0, extreme: bool = False) -> tuple[str, str]:
    """(class, detail) for one OpInfo; ``extreme``: a fourth call at ``EXTREMES`` values."""
    if torch.float32 not in op.supported_dtypes("cpu"):
        return SKIPPED, "no float32 on cpu"
    if op.name.split(".")[0] in UNSPECIFIED:
        return SKIPPED, "its values are unspecified (uninitialised memory)"
    try:
        sample = next(iter(op.sample_inputs("cpu", torch.float32)))
    except StopIteration:
        return SKIPPED, "no sample"
    except Exception as error:  # noqa: BLE001
        return SKIPPED, f"sample_inputs raised {type(error).__name__}"
    with torch.no_grad():
        start = time.perf_counter()
        try:
            eager = _call(op.op, sample)
            eager_error = None
        except Exception as error:  # noqa: BLE001
            eager, eager_error = None, error
        took = time.perf_counter() - start
        if took > slow:
            return SKIPPED, f"eager call took {took:.1f} s"
        if eager_error is None:
            try:
                again = _call(op.op, sample)
            except Exception as error:  # noqa: BLE001
                return SKIPPED, f"eager raised on the second call only: {type(error).__name__}"
            if same(again, eager):
                return SKIPPED, "nondeterministic: eager differs from itself"
        f = cr.compile(lambda *a, **k: op.op(*a, **k))
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        caught: list[str] = []
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                for i in range(3):
                    try:
                        got = _call(f, sample)
                    except TimeBox:
                        raise
                    except Exception as error:  # noqa: BLE001
                        if eager_error is None:
                            return BUG_RAISE, f"call {i + 1}: {type(error).__name__}: {str(error)[:300]} at {_innermost(error)}"
                        if type(error) is not type(eager_error):
                            return BUG_RAISE, (f"call {i + 1}: {type(error).__name__} ({str(error)[:200]}) at "
                                               f"{_innermost(error)}, eager {type(eager_error).__name__}")
                        continue
                    if eager_error is not None:
                        return BUG_DIFF, f"call {i + 1} returned where eager raised {type(eager_error).__name__}: {eager_error}"
                    why = same(got, eager)
                    if why:
                        return BUG_DIFF, f"call {i + 1}: {why}"
                if extreme and eager_error is None:
                    why = _extreme_call(op, f)
                    if why:
                        return BUG_DIFF, f"at extreme values: {why}"
            caught = [str(w.message).splitlines()[0][:200] for w in record]
        except TimeBox:
            return SKIPPED, f"past {timeout:.0f} s for three calls"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if eager_error is not None:
            return BOTH_RAISE, f"{type(eager_error).__name__}"
        hits = sum(c.hits for c in f.captures)
        if hits:
            return SERVED, f"{hits} hits"
        reason = f.fallback_reason or (caught[0] if caught else f"state {f.state.name}, no hits")
        return EAGER, reason


def _extreme_call(op: Any, f: Any) -> str | None:
    """What the compiled call gets wrong on the sample at ``EXTREMES`` values (None: nothing, or
    eager raises or is nondeterministic there)."""
    sample = next(iter(op.sample_inputs("cpu", torch.float32)))
    try:
        eager = _call(op.op, sample, extreme=True)
        if same(_call(op.op, sample, extreme=True), eager, scaled=True):
            return None
    except Exception:  # noqa: BLE001 (the op's domain: eager refuses these values)
        return None
    try:
        got = _call(f, sample, extreme=True)
    except TimeBox:
        raise
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error)[:200]} at {_innermost(error)}"
    return same(got, eager, scaled=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="op name (repeatable)")
    parser.add_argument("--limit", type=int, help="the first N ops only")
    parser.add_argument("--start", type=int, default=0, help="skip the first N ops")
    parser.add_argument("--slow", type=float, default=1.0, help="skip ops whose eager call takes longer (s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="time box for the three compiled calls (s)")
    parser.add_argument("--extreme", action="store_true", help="a fourth call at EXTREMES values")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per op")
    args = parser.parse_args(argv)
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")
    ops = [op for op in op_db if not args.only or op.name in args.only or f"{op.name}.{op.variant_test_name}" in args.only]
    ops = ops[args.start:]
    if args.limit is not None:
        ops = ops[: args.limit]
    counts: Counter[str] = Counter()
    bugs: list[tuple[str, str, str]] = []
    start = time.perf_counter()
    for op in ops:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        t0 = time.perf_counter()
        kind, detail = sweep_one(op, args.slow, args.timeout, args.extreme)
        counts[kind] += 1
        if kind.startswith("BUG"):
            bugs.append((name, kind, detail))
        if args.verbose or kind.startswith("BUG"):
            print(f"{kind:12s} {name:40s} {time.perf_counter() - t0:5.1f}s  {detail}", flush=True)
    print(f"\n{len(ops)} ops in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{k} {counts[k]}" for k in (SERVED, EAGER, BOTH_RAISE, BUG_RAISE, BUG_DIFF, SKIPPED)))
    for name, kind, detail in bugs:
        print(f"  {kind} {name}: {detail}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
