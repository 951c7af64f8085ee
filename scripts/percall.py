"""Instructions per served call, by step, counted by callgrind (repeatable on a loaded machine).

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg/out.%p \\
        python scripts/percall.py [--workloads mlp_b1 cnn_b1] [--calls 2000]

Each step runs ``--calls`` times in a region of its own (counters zeroed before, dumped after,
through callgrind's client requests: a 20-line C helper built with gcc and valgrind's header);
an empty loop's count is subtracted, so a figure is the step's own instructions per call.
Outside valgrind the regions are no-ops; ``--time`` instead times ``clika``, ``ort_run`` and
``floor`` interleaved (scripts/timing.py) and prints the paired ratios with the machine's load,
a second opinion on a loaded machine. ``--added`` times the runner alone and with each check
before it (``weights``, ``state``, ``fresh``, ``flat``: each step's cost in a loop of served
calls, where the run after it pays too: what the check's memory traffic evicts), and the whole
call, interleaved, each step also alone. The steps:

- ``ort_run``: ``InferenceSession.run(None, feeds)``; ``floor``: the pre-bound IOBinding run
  (``bench.floor_binding``: inputs and outputs bound once);
- ``runner``: the capture's runner (bind the inputs, run, hand outputs out as tensors);
- ``run``: the capture's ``run`` closure (the runner, the hit count, the output tree);
- ``fits``: ``guard.fits``; ``weights``: ``table.watch.fresh()``; ``state``: the state watch
  with the weights taken as fresh; ``fresh``: ``table.fresh()`` (weights, state, autocast, grad);
- ``flat``: the flat hit (key checks, ``fits``, ``run``); ``clika``: the whole served call.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import current, floor_binding, session_for  # noqa: E402
from timing import measure, median, paired_ratio  # noqa: E402
from workloads import build  # noqa: E402

import clika_runtime as cr  # noqa: E402

_HELPER = r"""
#include <valgrind/callgrind.h>
void region_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void region_end(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def _helper() -> Any:
    folder = Path(tempfile.mkdtemp())
    (folder / "cg.c").write_text(_HELPER)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(folder / "cg.so"), str(folder / "cg.c")], check=True)
    lib = ctypes.CDLL(str(folder / "cg.so"))
    lib.region_end.argtypes = [ctypes.c_char_p]
    return lib


def steps(w: Any) -> dict[str, Callable[[], Any]]:
    """The served call of ``w`` and each of its steps, as argument-less callables."""
    inputs = w.inputs(w.size)
    f = cr.compile(w.model)
    f(*inputs)
    f(*w.inputs(w.size))
    assert f.state is cr.CompiledFunction.State.Compiled, f.recapture_reasons
    table, capture = f._lifecycle.table, current(f)
    session = session_for(str(capture.folder.opened))
    feeds = {name: t.numpy() for name, t in zip(capture.graph().input_names, inputs)}
    binding = floor_binding(session, feeds)
    listed = list(inputs)
    state = table.snapshot.check(lambda: True, modes=False) if table.snapshot.parts else (lambda: True)
    return {
        "loop": lambda: None,
        "ort_run": lambda: session.run(None, feeds),
        "floor": lambda: session.run_with_iobinding(binding),
        "runner": lambda: capture.parts.runner.run(listed),
        "run": lambda: capture.run(listed),
        "fits": lambda: capture.guard.fits(inputs),
        "weights": table.watch.fresh,
        "state": state,
        "fresh": table.fresh,
        "flat": lambda: table.flat(inputs),
        "clika": lambda: f(*inputs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=["mlp_b1", "cnn_b1"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", nargs="*", default=None, help="only these steps (and the empty loop)")
    parser.add_argument("--time", action="store_true", help="time clika, ort_run and floor interleaved instead")
    parser.add_argument("--added", action="store_true", help="time the runner with each check added instead")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cr.config.cache_dir = None
    if args.time:
        return timed(args)
    if args.added:
        return added(args)
    lib = _helper()
    for w in build(tuple(args.workloads)):
        with torch.no_grad():
            variants = steps(w)
            for name, fn in variants.items():
                if args.steps is not None and name not in (*args.steps, "loop"):
                    continue
                for _ in range(200):  # warm-up: caches, lazily made bindings
                    fn()
                lib.region_start()
                for _ in range(args.calls):
                    fn()
                lib.region_end(f"{w.name}:{name}".encode())
    return 0


def timed(args: argparse.Namespace) -> int:
    """The served call against a plain run and the floor, interleaved rounds, with the load."""
    for w in build(tuple(args.workloads)):
        with torch.no_grad():
            every = steps(w)
            chosen = {name: every[name] for name in ("clika", "ort_run", "floor")}
            samples = measure(chosen, args.rounds, 0.02)
        load = os.getloadavg()[0]
        print(f"{w.name}: clika {median(samples['clika']):.1f} us, ort_run {median(samples['ort_run']):.1f} us, "
              f"floor {median(samples['floor']):.1f} us; clika/ort_run {paired_ratio(samples['clika'], samples['ort_run']):.3f}, "
              f"clika/floor {paired_ratio(samples['clika'], samples['floor']):.3f} (1-minute load {load:.1f})")
    return 0


def added(args: argparse.Namespace) -> int:
    """Per workload: each check alone, and the runner with it before the run, interleaved (us per call)."""
    for w in build(tuple(args.workloads)):
        with torch.no_grad():
            every = steps(w)
            runner = every["runner"]
            checks = {name: every[name] for name in ("weights", "state", "fresh")}
            chosen = {"floor": every["floor"], "runner": runner, "flat": every["flat"], "clika": every["clika"],
                      **{f"{name}+runner": _before(check, runner) for name, check in checks.items()}, **checks}
            samples = measure(chosen, args.rounds, 0.02)
        base = median(samples["runner"])
        print(f"{w.name} (1-minute load {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{name} {median(times):.1f} us" + (f" (+{median(times) - base:.1f})" if "+" in name else "")
            for name, times in samples.items()))
    return 0


def _before(check: Callable[[], Any], run: Callable[[], Any]) -> Callable[[], Any]:
    def both() -> Any:
        check()
        return run()

    return both


def report(folder: str, calls: int) -> None:
    """Print instructions per call by step from the dumps callgrind wrote to ``folder``."""
    totals: dict[str, dict[str, int]] = {}
    for path in sorted(Path(folder).iterdir()):
        text = path.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if trigger and total and ":" in trigger.group(1):
            workload, step = trigger.group(1).split(":")
            totals.setdefault(workload, {})[step] = int(total.group(1))
    for workload, counts in totals.items():
        loop = counts.pop("loop", 0)
        print(workload + ": " + ", ".join(f"{s} {(c - loop) / calls:,.0f}" for s, c in counts.items()))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2000)
    else:
        sys.exit(main())
