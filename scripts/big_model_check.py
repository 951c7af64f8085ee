"""Past protobuf's 2 GB limit: capture, serve, save (external data) and reload torch-free a model
of at least 600M parameters built from a config (random weights). Not run in CI.

    python scripts/big_model_check.py [--out out/big]

Prints the parameter count, each phase's time, peak RSS, and whether the reloaded graph (served
in a process without torch) gives the same numbers as eager.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

import clika_runtime as cr

ROOT = Path(__file__).resolve().parent.parent


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512)
    return LlamaModel(config)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "out" / "big"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cr.config.cache_dir = None
    torch.manual_seed(0)
    start = time.perf_counter()
    m = model().eval()
    params = sum(p.numel() for p in m.parameters())
    print(f"params {params / 1e6:.0f}M ({params * 4 / 2**30:.2f} GiB fp32), built in {time.perf_counter() - start:.0f} s")
    ids = torch.randint(0, 32000, (1, 64))
    f = cr.compile(m)
    with torch.no_grad():
        start = time.perf_counter()
        f(input_ids=ids, use_cache=False)
        print(f"first call (capture) {time.perf_counter() - start:.0f} s: {f.captures[0].phases}")
        start = time.perf_counter()
        served = f(input_ids=ids, use_cache=False).last_hidden_state
        print(f"served call {time.perf_counter() - start:.2f} s; peak RSS so far {peak_rss_gib():.1f} GiB")
        expected = m(input_ids=ids, use_cache=False).last_hidden_state
    print(f"served vs eager max |diff| {(served - expected).abs().max().item():.2e}")
    start = time.perf_counter()
    path = f.take_graph().save(out / "big.onnx")
    print(f"saved {path} in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{p.name} {p.stat().st_size / 2**30:.2f} GiB" for p in sorted(out.iterdir())))
    np.save(out / "ids.npy", ids.numpy())
    np.save(out / "expected.npy", expected.numpy())
    check = textwrap.dedent(f"""
        import sys, time
        sys.modules["torch"] = None  # a deployment box: no torch
        import numpy as np, clika_runtime as cr
        start = time.perf_counter()
        served = cr.load({str(path)!r})
        out = served(input_ids=np.load({str(out / 'ids.npy')!r}), use_cache=False)
        diff = np.abs(out["last_hidden_state"] - np.load({str(out / 'expected.npy')!r})).max()
        print(f"reloaded torch-free and served in {{time.perf_counter() - start:.0f}} s: max |diff| {{diff:.2e}}")
    """)
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT)
    print(result.stdout.strip() or result.stderr.strip()[-2000:])
    print(f"peak RSS {peak_rss_gib():.1f} GiB")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
