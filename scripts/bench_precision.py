"""Precision: reduced-precision serving against what a user would pick instead, one process per model.

    python scripts/bench_precision.py [--models bert_base roberta_base electra_base distilbert_base cnn]
                                      [--rounds 7] [--threads 2] [--block-s 0]
                                      [--optimum DIR] [--save-models DIR]

For each model (random weights from its default config): eager fp32, eager under bf16 autocast,
torch's dynamic int8 (``quantize_dynamic`` of every ``nn.Linear``), and clika_runtime served at
fp32 and at int8 (``precision="int8"``), at (batch, sequence) (1, 128), (8, 128) and (1, 512)
(the CNN at batch 1 and 16). Each figure is the median over interleaved rounds (every variant
once per round, in shuffled order; with ``--block-s``, a block of calls lasting about that
long), as a ratio to eager fp32 within the round; agreement is the cosine similarity of the
first output with eager fp32's. Targets (issue 24): int8 served <=
0.33x eager at every point of the transformers, fp32 served <= 1.0x.

Optimum's int8 as a peer, in the same process: ``--save-models DIR`` writes the transformers with
the weights measured here (``DIR/bert_base``...); ``scripts/optimum_int8.py`` (in a venv of its own)
exports and quantizes each to ``DIR/<model>_optimum/model_quantized.onnx``; ``--optimum DIR``
then times that file in onnxruntime beside the others.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import measure  # noqa: E402

import clika_runtime as cr  # noqa: E402

INT8_TARGET, FP32_TARGET = 0.33, 1.0
SHAPES = ((1, 128), (8, 128), (1, 512))


def bert_base() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig())


def roberta_base() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaModel

    return RobertaModel(RobertaConfig(max_position_embeddings=514))  # roberta-base's: positions start at 2


def electra_base() -> torch.nn.Module:
    """ELECTRA-base's discriminator encoder: not used by the tests (issue 24's own check)."""
    from transformers import ElectraConfig, ElectraModel

    return ElectraModel(ElectraConfig(embedding_size=768, hidden_size=768, num_hidden_layers=12,
                                      num_attention_heads=12, intermediate_size=3072))


def distilbert_base() -> torch.nn.Module:
    """DistilBERT-base: six layers, no token types (not used by the tests)."""
    from transformers import DistilBertConfig, DistilBertModel

    return DistilBertModel(DistilBertConfig())


class SmallCNN(torch.nn.Module):
    """Three conv blocks and a linear head over 64x64 images."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for inputs, outputs in ((3, 32), (32, 64), (64, 128)):
            layers += [torch.nn.Conv2d(inputs, outputs, 3, padding=1), torch.nn.BatchNorm2d(outputs), torch.nn.ReLU(),
                       torch.nn.MaxPool2d(2)]
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(128 * 8 * 8, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"bert_base": bert_base, "roberta_base": roberta_base,
                                                    "electra_base": electra_base, "distilbert_base": distilbert_base,
                                                    "cnn": SmallCNN}


def inputs_for(name: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    if name == "cnn":
        return {"x": torch.randn(shape[0], 3, 64, 64)}
    ids = torch.randint(5, 1000, shape)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "roberta_base":  # its own buffer of token types ends at 512 positions, which start at 2
        inputs["token_type_ids"] = torch.zeros_like(ids)
    return inputs


def first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.reshape(1, -1).double(), b.reshape(1, -1).double()).item()


def optimum_session(path: Path, threads: int) -> Callable[[dict], torch.Tensor]:
    """Optimum's quantized graph, run by onnxruntime with the same threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    wanted = [i.name for i in session.get_inputs()]

    def run(inputs: dict) -> torch.Tensor:
        feeds = {k: v.numpy() for k, v in inputs.items() if k in wanted}
        feeds.update({k: torch.zeros_like(inputs["input_ids"]).numpy() for k in wanted if k not in feeds})  # token_type_ids
        return torch.from_numpy(session.run(None, feeds)[0])

    return run


def variants(name: str, model: torch.nn.Module, optimum: Path | None, threads: int
             ) -> dict[str, Callable[[dict], torch.Tensor]]:
    """Each way of running the model, as a function of the call's inputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        torch_int8 = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    served = {p: cr.compile(model, dynamic=True, precision=p) for p in ("fp32", "int8")}
    example = inputs_for(name, (2, 64))
    for f in served.values():
        f(**example)  # the capture: not timed
        print(f"  {name} {f.captures[0].precision or 'fp32'}; capture phases "
              + ", ".join(f"{k} {v:.1f} s" for k, v in f.captures[0].phases.items()), flush=True)

    def bf16(inputs: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return first(model(**inputs)).float()

    runs = {
        "eager": lambda inputs: first(model(**inputs)),
        "bf16_autocast": bf16,
        "torch_int8": lambda inputs: first(torch_int8(**inputs)),
        "clika_fp32": lambda inputs: first(served["fp32"](**inputs)),
        "clika_int8": lambda inputs: first(served["int8"](**inputs)),
    }
    quantized = optimum / f"{name}_optimum" / "model_quantized.onnx" if optimum is not None else None
    if quantized is not None and quantized.is_file():
        runs["optimum_int8"] = optimum_session(quantized, threads)
    return runs


def model_of(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def bench(name: str, rounds: int, optimum: Path | None, threads: int, block_s: float) -> list[str]:
    model = model_of(name)
    verdicts = []
    with torch.inference_mode():
        runs = variants(name, model, optimum, threads)
        shapes = ((1, 0), (16, 0)) if name == "cnn" else SHAPES
        each = f"blocks of about {block_s} s" if block_s else "one call"
        print(f"\n{name}: ratio to eager fp32 (median of {rounds} interleaved rounds of {each} per variant), "
              "cosine with eager fp32")
        for shape in shapes:
            inputs = inputs_for(name, shape)
            for run in runs.values():  # a size new to a graph is checked against eager on its first call
                run(inputs)
            reference = runs["eager"](inputs)
            agreement = {v: cosine(run(inputs), reference) for v, run in runs.items()}
            samples = measure({v: (lambda run=run: run(inputs)) for v, run in runs.items()}, rounds, block_s, warmup=1)
            ratios = {v: statistics.median(x / e for x, e in zip(samples[v], samples["eager"])) for v in runs}
            label = f"batch {shape[0]}" if name == "cnn" else f"({shape[0]}, {shape[1]})"
            eager_ms = statistics.median(samples["eager"]) / 1e3
            print(f"  {label:<10} eager {eager_ms:8.1f} ms  " + "  ".join(
                f"{v} {ratios[v]:.2f}x ({agreement[v]:.5f})" for v in runs if v != "eager"), flush=True)
            if name != "cnn":
                verdicts.append(f"{name} {label}: int8 served {ratios['clika_int8']:.2f}x eager (target <= {INT8_TARGET}) "
                                f"{'met' if ratios['clika_int8'] <= INT8_TARGET else 'MISSED'}, cosine "
                                f"{agreement['clika_int8']:.5f}; fp32 served {ratios['clika_fp32']:.2f}x (target <= "
                                f"{FP32_TARGET}) {'met' if ratios['clika_fp32'] <= FP32_TARGET else 'MISSED'}")
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["bert_base", "roberta_base", "cnn"], choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-s", type=float, default=0.0,
                        help="time each variant in blocks of about this many seconds (default: one call)")
    parser.add_argument("--optimum", type=Path, help="a folder of Optimum's int8 graphs (scripts/optimum_int8.py)")
    parser.add_argument("--save-models", type=Path, help="write the transformers measured here, for optimum_int8.py")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the model this process measures
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cr.config.cache_dir = None  # every capture exports
    if args.save_models:
        for name in (m for m in args.models if m != "cnn"):
            model_of(name).save_pretrained(args.save_models / name)
        return 0
    if args.one:
        print("\n".join(bench(args.one, args.rounds, args.optimum, args.threads, args.block_s)))
        return 0
    for name in args.models:  # one process per model: no model's memory or threads weigh on another's
        extra = ["--optimum", str(args.optimum)] if args.optimum else []
        subprocess.run([sys.executable, __file__, "--one", name, "--rounds", str(args.rounds),
                        "--threads", str(args.threads), "--block-s", str(args.block_s), *extra], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
