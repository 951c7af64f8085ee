"""Which way of calling onnxruntime from torch tensors is fastest on CPU (the serving hot path).

    python scripts/bench_paths.py [--workloads mlp_b1 cnn_b1 ...] [--rounds 9]

Each variant takes torch tensors and returns fresh torch tensors (except `floor`, which binds
inputs and outputs once: onnxruntime alone). Interleaved rounds, medians in us per call, 1 thread.
"outputs kept" is the runner's "reused binding" path (outputs stay allocated in the binding and
are copied out); "_sess.run (numpy)" its "numpy" path, for outputs too large or not of fixed
shape. The last two rows time whole compiled calls: the flat hit against the general hit path
(flatten, key, lookup, guard) on the same runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi import _pybind_state as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import build  # noqa: E402

import clika_runtime as cr  # noqa: E402

_NP = {torch.float32: np.float32, torch.int64: np.int64}


def variants_for(session: ort.InferenceSession, inputs: tuple, out_shapes: list) -> dict[str, Callable[[], Any]]:
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    inner, options = session._sess, C.RunOptions()
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)

    def bind(binding: Any) -> list[torch.Tensor]:
        for name, t in zip(names, inputs):
            binding.bind_input(name, device, _NP[t.dtype], list(t.shape), t.data_ptr())
        fresh = [torch.empty(shape) for shape in out_shapes]
        for name, o in zip(outputs, fresh):
            binding.bind_output(name, device, np.float32, list(o.shape), o.data_ptr())
        return fresh

    def public_iobinding() -> list[torch.Tensor]:
        binding = session.io_binding()
        for name, t in zip(names, inputs):
            binding.bind_input(name, "cpu", 0, _NP[t.dtype], list(t.shape), t.data_ptr())
        fresh = [torch.empty(shape) for shape in out_shapes]
        for name, o in zip(outputs, fresh):
            binding.bind_output(name, "cpu", 0, np.float32, list(o.shape), o.data_ptr())
        session.run_with_iobinding(binding)
        return fresh

    def c_iobinding_per_call() -> list[torch.Tensor]:
        binding = C.SessionIOBinding(inner)
        fresh = bind(binding)
        inner.run_with_iobinding(binding, options)
        return fresh

    reused = C.SessionIOBinding(inner)

    def c_iobinding_reused() -> list[torch.Tensor]:
        fresh = bind(reused)
        inner.run_with_iobinding(reused, options)
        return fresh

    def dlpack_ortvalues() -> list[torch.Tensor]:
        feed = {name: C.OrtValue.from_dlpack(t.__dlpack__()) for name, t in zip(names, inputs)}
        return [torch.from_dlpack(v.to_dlpack()) for v in inner.run_with_ort_values(feed, outputs, options)]

    kept = C.SessionIOBinding(inner)
    for name in outputs:
        kept.bind_output(name, device)
    codes = {torch.float32: 1, torch.int64: 7}

    def c_iobinding_outputs_kept() -> list[torch.Tensor]:
        for name, t in zip(names, inputs):
            kept.bind_input(name, device, codes[t.dtype], t.shape, t.data_ptr())
        inner.run_with_iobinding(kept, options)
        return [torch.from_numpy(a) for a in kept.copy_outputs_to_cpu()]

    floor = C.SessionIOBinding(inner)
    floor_outputs = bind(floor)  # kept alive: the binding writes into them on every run

    def bound_once() -> list[torch.Tensor]:
        inner.run_with_iobinding(floor, options)
        return floor_outputs

    return {
        "public run (numpy)": lambda: [torch.from_numpy(a) for a in session.run(outputs, {n: t.numpy() for n, t in zip(names, inputs)})],
        "_sess.run (numpy)": lambda: [torch.from_numpy(a) for a in inner.run(outputs, {n: t.numpy() for n, t in zip(names, inputs)}, options)],
        "public IOBinding": public_iobinding,
        "C IOBinding per call": c_iobinding_per_call,
        "C IOBinding reused": c_iobinding_reused,
        "C IOBinding, outputs kept": c_iobinding_outputs_kept,
        "DLPack OrtValues": dlpack_ortvalues,
        "floor (bound once)": bound_once,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=["mlp_b1", "cnn_b1", "cnn_b16"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for w in build(tuple(args.workloads)):
        inputs = w.inputs(w.size)
        f = cr.compile(w.model)
        with torch.no_grad():
            expected = f(*inputs)
        session = f._lifecycle.table.current().parts.runner.session
        out_shapes = [tuple(expected.shape)]
        variants = variants_for(session, inputs, out_shapes)
        general = cr.compile(w.model)
        general(*inputs)

        general._lifecycle.table = dataclasses.replace(general._lifecycle.table, flat=None)  # no flat hit

        def general_path() -> Any:
            return general(*inputs)

        variants["clika (flat hit)"] = lambda: f(*inputs)
        variants["clika (general path)"] = general_path
        samples: dict[str, list[float]] = {k: [] for k in variants}
        once = time.perf_counter()
        variants["floor (bound once)"]()
        n = max(10, int(0.05 / max(time.perf_counter() - once, 1e-6)))
        for _ in range(args.rounds):
            for name, fn in variants.items():
                fn()
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - start) / n * 1e6)
        print(f"\n{w.name} (us per call, median of {args.rounds} rounds)")
        for name, values in samples.items():
            print(f"  {name:<26}{statistics.median(values):>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
