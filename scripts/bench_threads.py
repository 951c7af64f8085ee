"""Threads: two threads calling one compiled function against two threads calling a plain
``InferenceSession.run`` of the same graph, side by side in one run (1 intra-op thread each).

    python scripts/bench_threads.py [--workloads cnn_b4 gpt2_tiny_s32] [--rounds 7] [--seconds 0.5]

Throughput is calls per second over both threads; the ratio is the median over rounds of
clika / onnxruntime, each pair timed in the same round. Target: >= 0.9.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median  # noqa: E402
from workloads import build  # noqa: E402

import clika_runtime as cr  # noqa: E402

TARGET = 0.9


def throughput(call: Callable[[], Any], threads: int, seconds: float) -> float:
    """Calls per second made by ``threads`` threads calling ``call`` for ``seconds``."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def worker(i: int) -> None:
        start.wait()
        while not stop.is_set():
            call()
            counts[i] += 1

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - began)


def compare(name: str, rounds: int, seconds: float) -> str:
    (w,) = build((name.replace("cnn_b4", "cnn_b1"),))
    size = 4 if name == "cnn_b4" else w.size
    inputs = w.inputs(size)
    f = cr.compile(w.model)
    with torch.no_grad():
        f(*inputs)
        f(*inputs)
    capture = f._lifecycle.table.current()
    graph = capture.graph()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    # The file the compiled function serves (with onnxruntime's fused kernels when any applied).
    session = ort.InferenceSession(str(capture.folder.opened), options, providers=["CPUExecutionProvider"])
    feeds = {n: t.numpy() for n, t in zip(graph.input_names, inputs)}

    def served() -> Any:
        with torch.no_grad():
            return f(*inputs)

    ratios, ours, theirs = [], [], []
    for _ in range(rounds):
        a = throughput(served, 2, seconds)
        b = throughput(lambda: session.run(None, feeds), 2, seconds)
        ratios.append(a / b)
        ours.append(a)
        theirs.append(b)
    ratio = median(ratios)
    return (f"threads ({name}, 2 threads): clika {median(ours):.0f} calls/s, InferenceSession.run "
            f"{median(theirs):.0f} calls/s, ratio {ratio:.2f} (target >= {TARGET}) {'met' if ratio >= TARGET else 'MISSED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=["cnn_b4", "gpt2_tiny_s32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.workloads:
        print(compare(name, args.rounds, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
