"""Benchmarks: torch eager, torch.compile (inductor), raw onnxruntime and clika_runtime, one process.

    python scripts/bench.py [--sections served weights first-call cold-start threads decode real-size precision]
                            [--workloads mlp_b1 cnn_b1 ...] [--no-inductor] [--rounds 21] [--block 0.02]

Sections (default: all but real-size and precision, which take minutes):
- served: the served call against eager, inductor and onnxruntime (bare run, and bound once: the floor),
  and against the graph a user exports by hand (``torch.onnx.export(dynamo=True)``), bound once ("hand");
- weights: the per-call cost of checking that baked weights (and Python state) are unchanged;
- first-call: the first compiled call against the same steps done by hand;
- cold-start: a fresh process's first call with an empty and a warm on-disk cache (bench_startup.py);
- threads: two threads on a compiled function against two on InferenceSession.run (bench_threads.py);
- decode: time per generated token, eager against served (bench_decode.py);
- real-size: BERT-base and GPT-2 small captures, memory and speed (bench_realsize.py); BERT-base's
  cold start (bench_startup.py --workloads bert_base_s128);
- precision: BERT-base, RoBERTa-base and a small CNN served at fp32 and int8 against eager fp32,
  bf16 autocast and torch's dynamic int8, 2 threads, with agreement figures (bench_precision.py).

Every variant runs on 1 thread (torch and onnxruntime) but in real-size. Timings are interleaved in
rounds (scripts/timing.py); each ratio is the median over rounds of that round's ratio, so it
compares numbers measured under the same machine load. Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import measure, paired_ratio  # noqa: E402
from workloads import Workload, build  # noqa: E402

import clika_runtime as cr  # noqa: E402

TARGETS = {  # workload -> [(ratio name, limit)]
    "mlp_b1": [("clika/eager", 0.5), ("clika/ort_run", 1.0)],
    "cnn_b1": [("clika/hand", 1.10)],
    "cnn_b16": [("clika/hand", 1.10)],
    "gpt2_tiny_s32": [("clika/hand", 1.10)],
    "transformer_layer_s128": [("clika/eager", 1.0)],
}


def session_for(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def current(f: Any) -> Any:
    """The capture a compiled function served last (its graph and runner)."""
    return f._lifecycle.table.current()


def floor_binding(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> Any:
    """IOBinding with inputs and preallocated outputs bound once: onnxruntime alone, nothing else."""
    outputs = session.run(None, feeds)
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    keep = []
    for meta, out in zip(session.get_outputs(), outputs):
        buffer = np.empty_like(out)
        keep.append(buffer)
        binding.bind_output(meta.name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
    binding.keep = keep  # the buffers live as long as the binding
    return binding


def by_hand_binding(w: Workload, inputs: tuple) -> tuple[ort.InferenceSession, Any] | None:
    """The workload exported by hand (``torch.onnx.export(dynamo=True)``, its defaults), bound
    once like the floor: what a user gets without this library (``None`` where that export fails)."""
    path = os.path.join(tempfile.mkdtemp(prefix="bench_hand_"), "model.onnx")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(w.model, inputs, dynamo=True, optimize=True, verbose=False).save(path)
    except Exception as e:  # the user's export fails where ours needed its own translations
        print(f"{w.name}: no hand export ({type(e).__name__})")
        return None
    session = session_for(path)
    names = [i.name for i in session.get_inputs()]
    return session, floor_binding(session, {n: t.numpy() for n, t in zip(names, inputs)})


def bench_workload(w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    inputs = w.inputs(w.size)
    f = cr.compile(w.model)
    with torch.no_grad():
        f(*inputs)
        f(*w.inputs(w.size))
    assert f.state is cr.CompiledFunction.State.Compiled, f.recapture_reasons
    graph = current(f).graph()
    session = session_for(str(current(f).folder.opened))  # the file the compiled function serves (fused or not)
    feeds = {name: t.numpy() for name, t in zip(graph.input_names, inputs)}
    binding = floor_binding(session, feeds)
    variants: dict[str, Callable[[], Any]] = {}

    def eager() -> Any:
        with torch.inference_mode():
            return w.model(*inputs)

    variants["eager"] = eager
    if args.inductor:
        compiled = torch.compile(w.model)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(*inputs)

        def inductor() -> Any:
            with torch.inference_mode():
                return compiled(*inputs)

        variants["inductor"] = inductor
    variants["ort_run"] = lambda: session.run(None, feeds)
    variants["floor"] = lambda: session.run_with_iobinding(binding)
    hand = by_hand_binding(w, inputs)
    if hand is not None:
        variants["hand"] = lambda: hand[0].run_with_iobinding(hand[1])
    runner, feeds_in_order = current(f).parts.runner, list(inputs)
    variants["runner"] = lambda: runner.run(feeds_in_order)  # the graph's run alone: no checks, no output tree
    variants["clika"] = lambda: f(*inputs)
    with torch.no_grad():
        samples = measure(variants, args.rounds, args.block)
    result: dict[str, Any] = {name: statistics.median(values) for name, values in samples.items()}
    result["_samples"] = samples
    result["_memory"] = served_memory_growth(f, inputs, args.memory_calls)
    return result


def served_memory_growth(f: Any, inputs: tuple, calls: int) -> tuple[float, float]:
    """RSS (MiB) after 1,000 warm-up calls, and its growth over ``calls`` more served calls."""
    process = psutil.Process()
    with torch.no_grad():
        for _ in range(1000):
            f(*inputs)
        gc.collect()
        before = process.memory_info().rss
        for _ in range(calls):
            f(*inputs)
        gc.collect()
        after = process.memory_info().rss
    return before / 2**20, (after - before) / 2**20


def by_hand(w: Workload, inputs: tuple) -> None:
    """The first call's steps done by hand: eager, export, session, run, compare."""
    with torch.no_grad():
        eager = w.model(*inputs)
        program = torch.onnx.export(w.model, inputs, dynamo=True, optimize=True, verbose=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    out = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)})
    expected = eager if isinstance(eager, torch.Tensor) else eager[0]
    np.testing.assert_allclose(out[0], expected.numpy(), rtol=1e-3, atol=1e-4)


def by_clika(w: Workload, inputs: tuple) -> None:
    """The first compiled call: eager, capture, session, verification."""
    with torch.no_grad():
        cr.compile(w.model)(*inputs)


_COLD = """
import sys, time, warnings
sys.path.insert(0, {scripts!r})
warnings.simplefilter("ignore")
import torch
import bench
from workloads import build
torch.set_num_threads(1)
(w,) = build(({name!r},))
inputs = w.inputs(w.size)
start = time.perf_counter()
bench.{step}(w, inputs)
print(time.perf_counter() - start)
"""


def first_call(w: Workload, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """Seconds for the first compiled call vs the same steps by hand (medians of ``rounds``).

    ``cold``: each in a fresh process (imports done, nothing exported yet), the case of a first
    call. ``warm``: in this process after earlier exports (a re-capture, or a second function).
    """
    inputs = w.inputs(w.size)
    scripts = str(Path(__file__).resolve().parent)
    times: dict[str, list[float]] = {"cold hand": [], "cold clika": [], "warm hand": [], "warm clika": []}
    for _ in range(rounds):
        for step, name in (("by_hand", "hand"), ("by_clika", "clika")):
            code = _COLD.format(scripts=scripts, name=w.name, step=step)
            env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": ""}  # a capture, not a disk-cache hit
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            times[f"cold {name}"].append(float(done.stdout.strip().splitlines()[-1]))
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (by_hand if name == "hand" else by_clika)(w, inputs)
            times[f"warm {name}"].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {kind: (med[f"{kind} hand"], med[f"{kind} clika"]) for kind in ("cold", "warm")}


WEIGHT_CHECK_US = {"mlp_b1": 0.5}  # the per-call cost allowed, in us
WEIGHT_CHECK_SHARE = {"gpt2_tiny_s32": 0.02}  # ... and as a share of a served call


def weights_check(names: tuple[str, ...], rounds: int, block: float) -> list[str]:
    """The per-call cost of ``Watch.fresh()`` (weights unchanged?) against a served call, and of
    the whole staleness check (weights, Python state, no autocast) that a served call makes."""
    lines = []
    for w in build(names):
        inputs = w.inputs(w.size)
        f = cr.compile(w.model)
        with torch.no_grad():
            f(*inputs)
            f(*inputs)
        table = f._lifecycle.table
        fresh, everything, baked = table.watch.fresh, table.fresh, len(table.watch.baked)

        def served() -> Any:
            with torch.no_grad():
                return f(*inputs)

        samples = measure({"check": fresh, "all": everything, "served": served}, rounds, block)
        check, share = min(samples["check"]), paired_ratio(samples["check"], samples["served"])
        verdicts = []
        if w.name in WEIGHT_CHECK_US:
            verdicts.append(f"target <= {WEIGHT_CHECK_US[w.name]} us {'met' if check <= WEIGHT_CHECK_US[w.name] else 'MISSED'}")
        if w.name in WEIGHT_CHECK_SHARE:
            limit = WEIGHT_CHECK_SHARE[w.name]
            verdicts.append(f"target <= {limit:.0%} {'met' if share <= limit else 'MISSED'}")
        lines.append(f"weights check ({w.name}, {baked} tensors): {check:.2f} us per call, {share:.1%} of a served "
                     f"call" + (f" ({'; '.join(verdicts)})" if verdicts else ""))
        lines.append(f"whole staleness check ({w.name}: weights, {len(table.snapshot.parts)} parts of Python state, "
                     f"autocast): {min(samples['all']):.2f} us per call, "
                     f"{paired_ratio(samples['all'], samples['served']):.1%} of a served call")
    return lines


SECTIONS = ("served", "weights", "first-call", "cold-start", "threads", "decode", "real-size", "precision")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="*", default=[s for s in SECTIONS if s not in ("real-size", "precision")],
                        choices=SECTIONS)
    parser.add_argument("--workloads", nargs="*", default=None)
    parser.add_argument("--no-inductor", dest="inductor", action="store_false")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--block", type=float, default=0.02, help="seconds per timed block")
    parser.add_argument("--memory-calls", type=int, default=10_000)
    parser.add_argument("--first-call", default="mlp_b1", help="workload for the first-call comparison ('' to skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cr.config.cache_dir = None  # every capture here exports: the cold-start section measures the cache
    print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores; python {platform.python_version()}, "
          f"torch {torch.__version__}, onnxruntime {ort.__version__}, clika_runtime {cr.__version__}; 1 thread")
    verdicts: list[str] = []
    if "served" in args.sections:
        verdicts += served_section(args)
    if "weights" in args.sections:
        verdicts += weights_check(("mlp_b1", "gpt2_tiny_s32"), args.rounds, args.block)
    if "first-call" in args.sections and args.first_call:
        (w,) = build((args.first_call,))
        for kind, (hand, ours) in first_call(w).items():
            verdicts.append(f"first call ({w.name}, {kind}): by hand {hand:.2f} s, clika {ours:.2f} s, ratio {ours / hand:.2f} "
                            f"(target <= 1.3) {'met' if ours / hand <= 1.3 else 'MISSED'}")
    for section, script, *options in (("cold-start", "bench_startup.py"), ("threads", "bench_threads.py"),
                                      ("decode", "bench_decode.py"), ("real-size", "bench_realsize.py"),
                                      ("real-size", "bench_startup.py", "--workloads", "bert_base_s128"),
                                      ("precision", "bench_precision.py")):
        if section in args.sections:
            done = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / script), *options],
                                  capture_output=True, text=True)
            verdicts += (done.stdout.strip() or f"{section}: failed\n{done.stderr[-2000:]}").splitlines()
    print("\n" + "\n".join(verdicts))
    return 0


def served_section(args: argparse.Namespace) -> list[str]:
    """The served-call table (printed) and its verdicts."""
    workloads = build(tuple(args.workloads) if args.workloads else None)
    columns = ("eager", "inductor", "ort_run", "floor", "hand", "runner", "clika")
    header = f"{'workload':<24}" + "".join(f"{c:>10}" for c in columns) + \
        "   clika/eager  clika/ort_run  clika/floor  clika/hand  runner/floor"
    print("\nmedian us per call\n" + header)
    verdicts: list[str] = []
    for w in workloads:
        r = bench_workload(w, args)
        samples = r["_samples"]
        ratios = {f"{a}/{b}": paired_ratio(samples[a], samples[b]) if b in samples else float("nan")
                  for a, b in (("clika", "eager"), ("clika", "ort_run"), ("clika", "floor"), ("clika", "hand"),
                               ("runner", "floor"))}
        cells = "".join(f"{r[c]:>10.1f}" if c in r else f"{'-':>10}" for c in columns)
        print(f"{w.name:<24}{cells}   {ratios['clika/eager']:>11.2f}  {ratios['clika/ort_run']:>13.2f}  "
              f"{ratios['clika/floor']:>11.2f}  {ratios['clika/hand']:>10.2f}  {ratios['runner/floor']:>12.2f}")
        rss, growth = r["_memory"]
        verdicts.append(f"{w.name}: RSS {rss:.0f} MiB, growth over {args.memory_calls} served calls {growth:+.1f} MiB")
        for ratio, limit in TARGETS.get(w.name, []):
            verdict = "met" if ratios[ratio] <= limit else "MISSED"
            verdicts.append(f"{w.name}: {ratio} {ratios[ratio]:.3f} (target <= {limit}) {verdict}")
    return verdicts


if __name__ == "__main__":
    sys.exit(main())
