"""RSS, linecache and live objects over many captures of one small model, in this process.

    .venv/bin/python scripts/capture_memory.py --traffic reset --calls 200
    .venv/bin/python scripts/capture_memory.py --traffic hotcold --calls 300

``reset``: ``f.reset()`` before every call, so every call exports. ``hotcold``: a baked float over
12 values with ``cache_size`` 8 and no re-capture limit, so every call past the first 8 evicts a
capture and exports another. The on-disk cache is off: every capture runs the exporter.
"""

from __future__ import annotations

import argparse
import gc
import linecache

import psutil
import torch

import clika_runtime as cr

CHECKPOINTS = (1, 10, 25, 50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traffic", choices=("reset", "hotcold"), default="reset")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    cr.config.cache_dir = None
    cr.config.recapture_limit = 10**6
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    x = torch.randn(2, 8)
    f = cr.compile(net) if args.traffic == "reset" else cr.compile(lambda x, scale: net(x) * scale)
    process = psutil.Process()
    with torch.no_grad():
        for i in range(1, args.calls + 1):
            if args.traffic == "reset":
                f.reset()
                f(x)
            else:
                f(x, float(i % 12))
            if i in CHECKPOINTS or i % 50 == 0:
                gc.collect()
                print(f"{i:5d} calls: rss {process.memory_info().rss / 2**20:6.1f} MiB  "
                      f"linecache {len(linecache.cache):5d}  objects {len(gc.get_objects())}", flush=True)


if __name__ == "__main__":
    main()
