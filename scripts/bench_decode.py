"""Time per generated token of tiny decoders and encoder-decoders, eager vs served, on 1 thread
(a rough figure for issues 15 and 27).

    python scripts/bench_decode.py [--tokens 64] [--rounds 7] [--models gpt2 llama t5 bart whisper]

Two workloads per decoder: a greedy loop written by hand (``f(token, attention_mask=m,
past_key_values=cache)``) and ``model.generate`` with the model's forward compiled. One per
encoder-decoder: ``model.generate`` with the model's forward and its encoder's forward compiled
(``docs/DECODERS.md``), eager with its ``EncoderDecoderCache``. Eager and served
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


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, max_target_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None))


MODELS = {"gpt2": _gpt2, "llama": _llama, "t5": _t5, "bart": _bart, "whisper": _whisper}
SEQ2SEQ = {"t5", "bart", "whisper"}


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


def workloads(name: str, tokens: int) -> tuple[dict, tuple, tuple]:
    """The workloads of one model (name -> run(forwards)), its eager forwards and its served ones
    (the model's and, for an encoder-decoder, its encoder's; ``None`` for a decoder)."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    encoder = model.get_encoder() if name in SEQ2SEQ else None
    eager = (model.forward, encoder and encoder.forward)
    served = (cr.compile(model.forward), encoder and cr.compile(encoder.forward, dynamic=True))
    if name == "whisper":
        inputs = {"input_features": torch.randn(1, 8, 32)}
    else:
        ids = torch.randint(3, 100, (1, 8))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def use(forwards: tuple) -> None:
        model.forward = forwards[0]
        if encoder is not None:
            encoder.forward = forwards[1]

    def generate(forwards: tuple) -> list:
        use(forwards)
        try:
            return model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False).tolist()
        finally:
            use(eager)

    runs = {"generate": generate}
    if encoder is None:
        runs = {"loop": lambda forwards: _loop(forwards[0], inputs["input_ids"], tokens), **runs}
    return runs, eager, served


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
        runs, eager, served = workloads(name, args.tokens)
        with torch.no_grad():
            for workload, run in runs.items():
                assert run(served) == run(eager), f"{name} {workload}: served tokens differ from eager"  # captures
                times: dict[str, list[float]] = {"eager": [], "served": []}
                for _ in range(args.rounds):
                    for label, forwards in (("eager", eager), ("served", served)):
                        started = time.perf_counter()
                        run(forwards)
                        times[label].append((time.perf_counter() - started) / args.tokens)
                e, s = statistics.median(times["eager"]), statistics.median(times["served"])
                print(f"{name:8} {workload:9} {e * 1e3:15.3f} {s * 1e3:16.3f} {s / e:6.2f}")
        print(f"{'':8} captures: {sum(len(f.captures) for f in served if f is not None)}")


if __name__ == "__main__":
    main()
