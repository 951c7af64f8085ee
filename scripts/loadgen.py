"""Load generator for the KServe v2 server: requests/s and p50/p95/p99 latency, with and without batching.

    python scripts/loadgen.py [--workload cnn_b1|mlp_b1|wide_mlp|bert_base | --graph model.onnx]
                              [--concurrency 1 8 64] [--requests 2000] [--max-batch-sizes 1 8] [--batch-wait-ms 5]
    python scripts/loadgen.py --url 127.0.0.1:8000 --model NAME [--concurrency 1 8 64] [--requests 2000]

Without ``--url``: captures the workload's graph with a dynamic batch dim (or takes ``--graph``),
starts a local Ray Serve on 127.0.0.1 and serves the graph once per ``--max-batch-sizes`` value
(1 means no batching), driving each with the same load; the replica's batching decision is printed. With ``--url``: drives a running server as it is. Each request is
one row (batch 1) of random data sent by tritonclient (binary tensors, its default), with each
``--concurrency`` value's requests in flight in turn, after a warm-up of that many requests. The
client runs on the same machine as the server and takes its share of the cores; each row ends with
the machine's 1-minute load average, for machines shared with other work. Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as triton
from tritonclient.utils import triton_to_np_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    args = _parser().parse_args()
    print(f"machine: {platform.machine()}, {_cores()} cores; python {platform.python_version()}; "
          f"{args.requests} requests of batch 1 per row")
    if args.url:
        print(_HEADER)
        for concurrency in args.concurrency:
            _report(args.url, args.model, args.model, concurrency, args.requests)
    else:
        _serve_and_drive(args)


_HEADER = (f"{'server':<28} {'clients':>7} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
           f"{'graph runs':>10} {'rows/run':>8} {'load':>5}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="host:port of a running server (default: start one per batch size)")
    parser.add_argument("--model", default="loadgen", help="model name on that server")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", default="cnn_b1", choices=["mlp_b1", "cnn_b1", "wide_mlp", "bert_base"],
                        help="what to capture and serve: a batch workload of scripts/workloads.py, "
                             "wide_mlp (1024-4096-1024, 8 M weights) or bert_base (BERT-base's sizes, random "
                             "weights, 110 M parameters; one request is one sequence of 32 tokens)")
    source.add_argument("--graph", help="a .onnx file to serve instead")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="requests in flight, one row each")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    return parser


def _serve_and_drive(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    from clika_runtime import kserve

    path = args.graph or _capture(args.workload, Path(tempfile.mkdtemp(prefix="loadgen_")))
    port = _free_port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        for i, size in enumerate(args.max_batch_sizes):
            application = kserve.app(path, name=args.model, max_batch_size=size, batch_wait_ms=args.batch_wait_ms)
            handle = serve.run(application, name=args.model, route_prefix="/")
            if i == 0:
                print(f"graph: {Path(path).name}; the replica says: {handle.describe.remote().result()}\n{_HEADER}")
            label = "no batching" if size == 1 else f"batch <= {size}, wait {args.batch_wait_ms:g} ms"
            for concurrency in args.concurrency:
                _report(f"127.0.0.1:{port}", args.model, label, concurrency, args.requests)
    finally:
        serve.shutdown()
        ray.shutdown()


def _capture(workload_name: str, folder: Path) -> Path:
    """Capture the workload at two batch sizes (the batch dim becomes dynamic) and save the graph."""
    import torch
    from workloads import build

    import clika_runtime as cr

    if workload_name == "wide_mlp":  # a graph whose run costs milliseconds at batch 1, not microseconds
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).eval()
        make = lambda batch: (torch.randn(batch, 1024),)  # noqa: E731
    elif workload_name == "bert_base":  # the batch dim dynamic, the sequence at 32 tokens
        import transformers

        torch.manual_seed(0)
        model = transformers.BertModel(transformers.BertConfig()).eval()
        make = lambda batch: (torch.randint(0, 30522, (batch, 32)),)  # noqa: E731
    else:
        (workload,) = build((workload_name,))
        model, make = workload.model, workload.inputs
    f = cr.compile(model)
    with torch.no_grad():
        for size in (1, 3):
            f(*make(size))
    return f.take_graph().save(folder / f"{workload_name}.onnx")


def _report(url: str, model: str, label: str, concurrency: int, requests: int) -> None:
    with triton.InferenceServerClient(url) as client:
        inputs = _inputs(client.get_model_metadata(model))
        _drive(url, model, inputs, concurrency, concurrency)  # warm-up
        before = client.get_inference_statistics(model)["model_stats"][0]
        start = time.perf_counter()
        latencies = _drive(url, model, inputs, requests, concurrency)
        wall = time.perf_counter() - start
        after = client.get_inference_statistics(model)["model_stats"][0]
    runs = after["execution_count"] - before["execution_count"]
    rows = after["inference_count"] - before["inference_count"]
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]) * 1000
    print(f"{label:<28} {concurrency:7d} {len(latencies) / wall:7.0f} {p50:8.1f} {p95:8.1f} {p99:8.1f} "
          f"{runs:10d} {rows / max(runs, 1):8.2f} {os.getloadavg()[0]:5.1f}", flush=True)


def _inputs(metadata: dict[str, Any]) -> list[triton.InferInput]:
    """One row per input from the model's metadata (every dynamic axis sized 1): random floats, and
    zeros for integer inputs (valid ids for any embedding)."""
    rng = np.random.default_rng(0)
    inputs = []
    for spec in metadata["inputs"]:
        shape = [1 if d == -1 else d for d in spec["shape"]]
        dtype = triton_to_np_dtype(spec["datatype"])
        data = rng.standard_normal(shape).astype(dtype) if spec["datatype"].startswith("FP") else np.zeros(shape, dtype)
        tensor = triton.InferInput(spec["name"], shape, spec["datatype"])
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def _drive(url: str, model: str, inputs: list[triton.InferInput], requests: int, concurrency: int) -> np.ndarray:
    """Send ``requests`` with ``concurrency`` client threads; the latency of each, in seconds."""
    remaining = iter(range(requests))
    lock = threading.Lock()

    def worker() -> list[float]:
        latencies = []
        with triton.InferenceServerClient(url, network_timeout=120) as client:
            while True:
                with lock:
                    if next(remaining, None) is None:
                        return latencies
                start = time.perf_counter()
                client.infer(model, inputs)
                latencies.append(time.perf_counter() - start)

    with ThreadPoolExecutor(concurrency) as pool:
        results = [pool.submit(worker) for _ in range(concurrency)]
        return np.array([t for r in results for t in r.result()])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
