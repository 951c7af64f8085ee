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


def build(names: tuple[str, ...] | None = None) -> list[Workload]:
    """The workloads of docs/BENCHMARKS.md, in eval mode, seeded."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    cnn = CNN()
    layer = torch.nn.TransformerEncoderLayer(256, 4, batch_first=True)
    gpt2 = _gpt2()
    bert = _bert()
    all_workloads = [
        Workload("mlp_b1", mlp, lambda b: (torch.randn(b, 64),), 1, (1, 4)),
        Workload("cnn_b1", cnn, lambda b: (torch.randn(b, 3, 32, 32),), 1, (1, 3)),
        Workload("cnn_b16", cnn, lambda b: (torch.randn(b, 3, 32, 32),), 16, (16, 5)),
        Workload("transformer_layer_s128", layer, lambda s: (torch.randn(1, s, 256),), 128, (128, 17)),
        Workload("gpt2_tiny_s32", gpt2, lambda s: (torch.randint(0, 1000, (1, s)),), 32, (32, 9)),
        Workload("bert_tiny_s32", bert, lambda s: (torch.randint(0, 1000, (1, s)),), 32, (32, 9)),
    ]
    for w in all_workloads:
        w.model.eval()
    return [w for w in all_workloads if names is None or w.name in names]
