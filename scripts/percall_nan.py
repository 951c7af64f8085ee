"""What the NaN-propagating max pooling costs a served CNN call, and what a NaN check of the
input would cost instead, in instructions per call (callgrind; issue 28).

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg/out.%p \\
        python scripts/percall_nan.py [--calls 200]
    python scripts/percall.py --report /tmp/cg 200

Regions (``percall.py``'s helper): ``served_floor``, the served graph (an AveragePool, an IsNaN
and a Where beside each MaxPool) run through a pre-bound IOBinding; ``hand_floor``, the same
model exported by hand with ``torch.onnx.export(dynamo=True)`` (MaxPool alone), run the same
way; ``sum_isnan``: ``math.isnan(x.sum().item())``, one reduction over the input at batch 1
(``_b16``: at batch 16); ``isnan_any``: ``torch.isnan(x).any().item()``.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import current, floor_binding, session_for  # noqa: E402
from percall import _helper  # noqa: E402
from workloads import build  # noqa: E402

import clika_runtime as cr  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--hand", default="/tmp/cnn_hand.onnx", help="where the hand export is written")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cr.config.cache_dir = None
    lib = _helper()
    (w,) = build(("cnn_b1",))
    x, x16 = w.inputs(1)[0], torch.randn(16, 3, 32, 32)
    f = cr.compile(w.model)
    with torch.no_grad():
        f(x)
        f(x)
        served = session_for(str(current(f).folder.opened))
        torch.onnx.export(w.model, (x,), dynamo=True, optimize=True, verbose=False).save(args.hand)
    hand = session_for(args.hand)
    served_binding = floor_binding(served, {served.get_inputs()[0].name: x.numpy()})
    hand_binding = floor_binding(hand, {hand.get_inputs()[0].name: x.numpy()})
    variants = {
        "loop": lambda: None,
        "served_floor": lambda: served.run_with_iobinding(served_binding),
        "hand_floor": lambda: hand.run_with_iobinding(hand_binding),
        "isnan_any": lambda: torch.isnan(x).any().item(),
        "sum_isnan": lambda: math.isnan(x.sum().item()),
        "sum_isnan_b16": lambda: math.isnan(x16.sum().item()),
        "isnan_any_b16": lambda: torch.isnan(x16).any().item(),
    }
    with torch.no_grad():
        for name, fn in variants.items():
            for _ in range(50):
                fn()
            lib.region_start()
            for _ in range(args.calls):
                fn()
            lib.region_end(f"cnn_b1:{name}".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
