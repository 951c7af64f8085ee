"""The main job, end to end: capture a real small model, serve it through drifting sizes (a
one-token call included), ship the graph, reload it in plain onnxruntime, validate it as CI would,
and write it as a Triton model repository.

Run with `make demo`. Writes out/demo/ (the .onnx, a reference .npz, the Triton repository).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import GPT2Config, GPT2Model

import clika_runtime as cr
from clika_runtime.shipped.validation import save_reference, validate_graph

OUT = Path(__file__).resolve().parent.parent / "out" / "demo"


def median_us(fn, repeat: int = 50) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    model = GPT2Model(config).eval()
    f = cr.compile(model)

    def batch(seq: int):
        return torch.randint(0, 1000, (2, seq)), torch.ones(2, seq, dtype=torch.long)

    print("== capture and serve a tiny GPT-2 through drifting sequence lengths")
    with torch.no_grad():
        for seq in (16, 16, 24, 24, 1, 9, 40, 1):
            ids, mask = batch(seq)
            start = time.perf_counter()
            out = f(input_ids=ids, attention_mask=mask)
            ms = (time.perf_counter() - start) * 1e3
            eager = model(input_ids=ids, attention_mask=mask)
            diff = (out.last_hidden_state - eager.last_hidden_state).abs().max().item()
            print(f"seq {seq:>3}: {ms:8.1f} ms  state={f.state.name:<8} recaptures={f.recapture_count}  max|diff|={diff:.2e}")
        print("re-capture reasons:", f.recapture_reasons)
        print("input names:", f.input_names)
        print("captures:\n" + "\n".join(str(c) for c in f.captures))

        ids, mask = batch(32)
        eager_us = median_us(lambda: model(input_ids=ids, attention_mask=mask))
        served_us = median_us(lambda: f(input_ids=ids, attention_mask=mask))
        print(f"latency at seq 32 (median, 1 thread): eager {eager_us:.0f} us, served {served_us:.0f} us "
              f"({served_us / eager_us:.2f}x)")

    print("\n== ship: take the graph, save it, reload it in plain onnxruntime")
    graph = f.take_graph()
    path = graph.save(OUT / "gpt2_tiny.onnx")
    print(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB); dynamic axes {graph.dynamic_axes}")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids, mask = batch(21)
    (hidden,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    ok = np.allclose(hidden, expected, rtol=1e-4, atol=1e-4)
    print(f"plain onnxruntime at seq 21 matches eager: {ok}")

    served = cr.load(path)
    out = served(input_ids=ids.numpy(), attention_mask=mask.numpy())
    print(f"cr.load -> {type(out).__name__} with numpy {out.last_hidden_state.dtype} leaves")

    print("\n== validate as CI would (python -m clika_runtime validate ...)")
    reference = OUT / "gpt2_tiny_reference.npz"
    save_reference(reference, {"input_ids": ids, "attention_mask": mask}, {"last_hidden_state": expected})
    report = validate_graph(path, reference=reference, rtol=1e-4, atol=1e-4)
    print(report.table())

    print("\n== deploy: a Triton model repository (clika-runtime triton ..., or graph.to_triton)")
    folder = graph.to_triton(OUT / "triton", "gpt2_tiny")
    print(f"wrote {folder}: {sorted(str(p.relative_to(folder)) for p in folder.rglob('*') if p.is_file())}")
    print(f"serve it with: tritonserver --model-repository {(OUT / 'triton').resolve()}")
    print(f"or over KServe v2 on Ray Serve: clika-runtime serve {path}")
    return 0 if ok and report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
