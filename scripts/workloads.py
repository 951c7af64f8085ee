"""The benchmark and validation workloads, built in code (random weights, nothing downloaded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Workload:
    """A model and a maker of example inputs (args tuple) at a given size."""

    name: str
    model: torch.nn.Module
    inputs: Callable[[int], tuple[Any, ...]]  # size -> args
    size: int  # the benchmarked size (batch or sequence)
    sizes: tuple[int, ...]  # sizes the graph must serve (validation)


class CNN(torch.nn.Module):
    """3 x (conv + batchnorm + relu + maxpool) on 32x32, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        channels = 3
        for width in (16, 32, 64):
            layers += [torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.BatchNorm2d(width),
                       torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
            channels = width
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(64 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2Model(config)


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                vocab_size=1000, max_position_embeddings=128))


def _bert_base() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig())  # BERT-base's sizes: 110M parameters


def _ids(vocab: int) -> Callable[[int], tuple[Any, ...]]:
    return lambda s: (torch.randint(0, vocab, (1, s)),)


# name -> (model maker, inputs at a size, benchmarked size, sizes the graph must serve)
_MAKERS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], tuple[Any, ...]], int, tuple[int, ...]]] = {
    "mlp_b1": (lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)),
               lambda b: (torch.randn(b, 64),), 1, (1, 4)),
    "cnn_b1": (CNN, lambda b: (torch.randn(b, 3, 32, 32),), 1, (1, 3)),
    "cnn_b16": (CNN, lambda b: (torch.randn(b, 3, 32, 32),), 16, (16, 5)),
    "transformer_layer_s128": (lambda: torch.nn.TransformerEncoderLayer(256, 4, batch_first=True),
                               lambda s: (torch.randn(1, s, 256),), 128, (128, 17)),
    "gpt2_tiny_s32": (_gpt2, _ids(1000), 32, (32, 9)),
    "bert_tiny_s32": (_bert, _ids(1000), 32, (32, 9)),
}
# Real-size workloads: built only when named (seconds and hundreds of MiB each).
_LARGE = {"bert_base_s128": (_bert_base, _ids(30522), 128, (128, 64))}


def build(names: tuple[str, ...] | None = None) -> list[Workload]:
    """The workloads of docs/BENCHMARKS.md (all small ones when ``names`` is None), in eval mode,
    each seeded the same way whichever others are built."""
    chosen = tuple(_MAKERS) if names is None else names
    workloads = []
    for name in chosen:
        make, inputs, size, sizes = {**_MAKERS, **_LARGE}[name]
        torch.manual_seed(0)
        workloads.append(Workload(name, make().eval(), inputs, size, sizes))
    return workloads
