"""Time per generated token of tiny decoders, eager vs served, on 1 thread (a rough figure for issue 15).

    python scripts/bench_decode.py [--tokens 64] [--rounds 7] [--models gpt2 llama]

Two workloads per model: a greedy loop written by hand (``f(token, attention_mask=m,
past_key_values=cache)``) and ``model.generate`` with the model's forward compiled. Eager and served
runs are interleaved in rounds; the figure is the median over rounds of the whole run (prefill
included) divided by the number of new tokens. Captures are made before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import clika_runtime as cr


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=256,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _loop(call, ids: torch.Tensor, tokens: int) -> list[int]:
    mask = torch.ones_like(ids)
    out = call(ids, attention_mask=mask)
    cache, seen = out.past_key_values, []
    for _ in range(tokens):
        token = out.logits[:, -1:].argmax(-1)
        seen.append(int(token))
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = call(token, attention_mask=mask, past_key_values=cache)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cr.config.intra_op_threads = 1
    print(f"{'model':8} {'workload':9} {'eager ms/token':>15} {'served ms/token':>16} {'ratio':>6}")
    for name in args.models:
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        eager = model.forward
        served = cr.compile(model.forward)
        ids = torch.randint(1, 100, (1, 8))

        def generate(forward):
            model.forward = forward
            try:
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                      min_new_tokens=args.tokens, do_sample=False).tolist()
            finally:
                model.forward = eager

        workloads = {
            "loop": lambda forward: _loop(forward, ids, args.tokens),
            "generate": generate,
        }
        with torch.no_grad():
            for workload, run in workloads.items():
                assert run(served) == run(eager), f"{name} {workload}: served tokens differ from eager"  # captures
                times: dict[str, list[float]] = {"eager": [], "served": []}
                for _ in range(args.rounds):
                    for label, forward in (("eager", eager), ("served", served)):
                        started = time.perf_counter()
                        run(forward)
                        times[label].append((time.perf_counter() - started) / args.tokens)
                e, s = statistics.median(times["eager"]), statistics.median(times["served"])
                print(f"{name:8} {workload:9} {e * 1e3:15.3f} {s * 1e3:16.3f} {s / e:6.2f}")
        print(f"{'':8} captures: {len(served.captures)}")


if __name__ == "__main__":
    main()
