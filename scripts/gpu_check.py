"""The CUDA path end to end, for a machine with a GPU and onnxruntime-gpu installed.

    python scripts/gpu_check.py [--no-inductor]

Installs nothing: it needs torch with CUDA, onnxruntime-gpu, onnx, onnxscript, optree, transformers
already there. Checks, for each workload: the graph runs on the CUDA provider, outputs are CUDA
tensors equal to eager's, a call made under a side stream sees inputs that stream wrote, CPU inputs
given to a CUDA place come back as CPU outputs, and ``precision="fp16"`` serves a float16 graph
(outputs in eager's dtype, cosine >= 0.999 with eager fp32, the session's graph in float16); then
times eager, torch.compile, clika_runtime fp32 and fp16 on the GPU. Prints a table; exit code 0
only when every check passed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import build  # noqa: E402

import clika_runtime as cr  # noqa: E402


def cuda_time_us(fn: Callable[[], Any], repeat: int = 50) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def first_tensor(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def check_workload(w: Any, inductor: bool) -> tuple[list[str], dict[str, float]]:
    failures = []
    model = w.model.cuda()
    f = cr.compile(model)  # place=None: CUDA inputs + CUDA provider -> CUDA
    with torch.no_grad():
        for size in w.sizes:
            args = tuple(a.cuda() for a in w.inputs(size))
            got, expected = first_tensor(f(*args)), first_tensor(model(*args))
            if not got.is_cuda:
                failures.append(f"{w.name}: output on {got.device}, expected CUDA")
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
        if f.state is not cr.CompiledFunction.State.Compiled:
            failures.append(f"{w.name}: {f.recapture_reasons}")
        providers = f._lifecycle.table.current().parts.runner.session.get_providers()
        if providers[0] != "CUDAExecutionProvider":
            failures.append(f"{w.name}: session runs on {providers}")
        # Stream ordering: inputs written on a side stream, the call made under that stream.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            args = tuple((a.cuda() * 1) for a in w.inputs(w.sizes[-1]))
            got = first_tensor(f(*args))
        side.synchronize()
        torch.testing.assert_close(got, first_tensor(model(*args)), rtol=1e-3, atol=1e-3)
        # CPU tensors given to a CUDA place: copied to the GPU once, outputs back on the CPU.
        cpu_model = w.model.cpu()
        g = cr.compile(cpu_model, place="cuda")
        args = w.inputs(w.size)
        g(*args)
        out = first_tensor(g(*args))
        if out.device.type != "cpu":
            failures.append(f"{w.name}: CPU inputs on a CUDA place returned {out.device}")
        torch.testing.assert_close(out, first_tensor(cpu_model(*args)), rtol=1e-3, atol=1e-3)
        model = w.model.cuda()
        args = tuple(a.cuda() for a in w.inputs(w.size))
        half, problems = fp16_served(model, args, w.name)
        failures += problems
        times = {"eager": cuda_time_us(lambda: model(*args)), "clika": cuda_time_us(lambda: f(*args)),
                 "fp16": cuda_time_us(lambda: half(*args))}
        if inductor:
            compiled = torch.compile(model)
            compiled(*args)
            times["inductor"] = cuda_time_us(lambda: compiled(*args))
    return failures, times


def fp16_served(model: torch.nn.Module, args: tuple, name: str) -> tuple[Any, list[str]]:
    """``precision="fp16"`` on CUDA: served from the float16 graph, agreeing with eager fp32."""
    problems = []
    half = cr.compile(model, precision="fp16")
    half(*args)
    got, expected = first_tensor(half(*args)), first_tensor(model(*args))
    said = half.captures[0].precision
    if not said.startswith("fp16,"):
        problems.append(f"{name}: fp16 not served: {said}")
    if got.dtype != expected.dtype or not got.is_cuda:
        problems.append(f"{name}: fp16 output {got.dtype} on {got.device}, eager {expected.dtype} on {expected.device}")
    cosine = torch.nn.functional.cosine_similarity(got.reshape(1, -1).double(), expected.reshape(1, -1).double()).item()
    if cosine < 0.999:
        problems.append(f"{name}: fp16 cosine with eager {cosine:.5f} < 0.999")
    return half, problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-inductor", dest="inductor", action="store_false")
    args = parser.parse_args()
    if not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"no CUDA here: torch.cuda {torch.cuda.is_available()}, onnxruntime {ort.get_available_providers()}")
        return 2
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, onnxruntime {ort.__version__}")
    failures: list[str] = []
    print(f"{'workload':<24}{'eager us':>10}{'inductor':>10}{'clika':>10}{'fp16':>10}{'clika/eager':>13}{'fp16/eager':>12}")
    for w in build():
        try:
            problems, times = check_workload(w, args.inductor)
        except Exception as e:  # report every workload, not just the first failure
            failures.append(f"{w.name}: {type(e).__name__}: {e}")
            continue
        failures += problems
        inductor = f"{times['inductor']:>10.1f}" if "inductor" in times else f"{'-':>10}"
        print(f"{w.name:<24}{times['eager']:>10.1f}{inductor}{times['clika']:>10.1f}{times['fp16']:>10.1f}"
              f"{times['clika'] / times['eager']:>13.2f}{times['fp16'] / times['eager']:>12.2f}")
    print("\n".join(failures) or "all CUDA checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
