"""Real size: BERT-base and GPT-2 small (random weights, built from their default configs).

    python scripts/bench_realsize.py [--models bert_base gpt2_small] [--rounds 3]

For each: the first capture and two drift re-captures (sequence, then batch) with their phase
times and the RSS each adds, as a multiple of the weights' bytes (targets: <= 1.5x for the first,
<= 0.25x for each further one); then served against eager at sequence 128 and 512, batch 1 and 8,
with torch's default threads (target: served <= 0.8x eager). The disk cache is off: every capture
exports.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import measure, paired_ratio  # noqa: E402

import clika_runtime as cr  # noqa: E402

FIRST, FURTHER, SPEED = 1.5, 0.25, 0.8


def bert_base() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig())


def gpt2_small() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(use_cache=False))


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"bert_base": bert_base, "gpt2_small": gpt2_small}


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (batch, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def captures(name: str, model: torch.nn.Module, f: Any, weights: float) -> list[str]:
    lines = []
    for i, (batch, seq) in enumerate([(1, 128), (1, 512), (8, 128)]):
        before, start = rss_mib(), time.perf_counter()
        with torch.no_grad():
            f(**inputs(batch, seq))
        took, added = time.perf_counter() - start, rss_mib() - before
        phases = ", ".join(f"{k} {v:.1f}" for k, v in f.captures[-1].phases.items()) if f.captures else "-"
        limit = FIRST if i == 0 else FURTHER
        verdict = "met" if added / weights <= limit else "MISSED"
        lines.append(f"{name} capture {i + 1} (batch {batch}, seq {seq}): {took:.1f} s ({phases}), RSS "
                     f"+{added:.0f} MiB = {added / weights:.2f}x weights (target <= {limit}) {verdict}")
    return lines


def speeds(name: str, model: torch.nn.Module, f: Any, rounds: int) -> list[str]:
    lines = []
    for batch in (1, 8):
        for seq in (128, 512):
            feeds = inputs(batch, seq)

            def eager() -> Any:
                with torch.inference_mode():
                    return model(**feeds)

            def served() -> Any:
                with torch.no_grad():
                    return f(**feeds)

            samples = measure({"eager": eager, "served": served}, rounds, 0.05, warmup=1)
            ratio = paired_ratio(samples["served"], samples["eager"])
            lines.append(f"{name} batch {batch} seq {seq}: eager {min(samples['eager']) / 1e3:.1f} ms, served "
                         f"{min(samples['served']) / 1e3:.1f} ms, served/eager {ratio:.2f} (target <= {SPEED}) "
                         f"{'met' if ratio <= SPEED else 'MISSED'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cr.config.cache_dir = None
    print(f"torch threads {torch.get_num_threads()}")
    for name in args.models:
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        print(f"{name}: weights {weights:.0f} MiB")
        f = cr.compile(model)
        for line in captures(name, model, f, weights) + speeds(name, model, f, args.rounds):
            print(line, flush=True)
        del f, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
