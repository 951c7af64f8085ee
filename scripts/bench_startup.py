"""Cold start: the first call of a fresh process, with an empty on-disk capture cache and with a
warm one (what an earlier process left), each in its own process.

    python scripts/bench_startup.py [--workloads gpt2_tiny_s32 ...] [--rounds 3]

Each round empties a temporary cache, times a fresh process's first call (cold: it exports),
then another fresh process's first call (warm: it finds the graph). Medians over rounds; the
target is warm <= 0.1x cold.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
WORKLOADS = ("mlp_b1", "cnn_b1", "gpt2_tiny_s32", "bert_tiny_s32")
TARGET = 0.1

_FIRST_CALL = """
import sys, time, warnings
sys.path.insert(0, {scripts!r})
warnings.simplefilter("ignore")
import torch
import clika_runtime as cr
from workloads import build
torch.set_num_threads(1)
(w,) = build(({name!r},))
inputs = w.inputs(w.size)
f = cr.compile(w.model)
start = time.perf_counter()
with torch.no_grad():
    f(*inputs)
print(time.perf_counter() - start)
"""


def first_call_s(name: str, cache: str) -> float:
    """Seconds of a fresh process's first compiled call with ``cache`` as its capture cache."""
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": cache}
    code = _FIRST_CALL.format(scripts=str(SCRIPTS), name=name)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(done.stdout.strip().splitlines()[-1])


def cold_start(names: tuple[str, ...], rounds: int) -> list[str]:
    """One line per workload: cold and warm first calls, their ratio and the verdict."""
    lines = []
    for name in names:
        cold, warm = [], []
        for _ in range(rounds):
            with tempfile.TemporaryDirectory() as cache:
                cold.append(first_call_s(name, cache))
                warm.append(first_call_s(name, cache))
        ratio = median(warm) / median(cold)
        lines.append(f"cold start ({name}): first call, empty cache {median(cold):.3f} s, warm cache "
                     f"{median(warm):.3f} s, ratio {ratio:.3f} (target <= {TARGET}) {'met' if ratio <= TARGET else 'MISSED'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("\n".join(cold_start(tuple(args.workloads), args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
