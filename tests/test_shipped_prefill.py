"""A shipped prefill graph captured from ``generate`` (it was called with an empty ``DynamicCache``):
``inspect`` says how to pass the cache, and ``cr.load`` takes the call a user writes first (no
cache, ``cache=None``) as well as ``cache=((), ())``. Real transformers, torch and onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import clika_runtime as cr
from clika_runtime.base.errors import GraphInputError
from clika_runtime.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids, attention_mask=torch.ones_like(ids)).logits[:, -1].numpy()
        model.forward = cr.compile(model.forward)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    prefill, decode = sorted(model.forward.graphs(), key=lambda g: len(g.input_names))
    folder = tmp_path_factory.mktemp("prefill")
    return prefill.save(folder / "prefill.onnx"), decode.save(folder / "decode.onnx"), ids.numpy(), eager


def _statics() -> dict:
    return {"logits_to_keep": 1, "use_cache": True, "return_dict": True}  # as generate called it


@pytest.mark.parametrize("cache", ["empty tuples", "None", "left out"])
def test_a_prefill_takes_an_empty_cache_none_or_none_at_all(shipped, cache):
    prefill_path, decode_path, ids, eager = shipped
    prefill, decode = cr.load(prefill_path), cr.load(decode_path)
    given = {"empty tuples": {"cache": ((), ())}, "None": {"cache": None}, "left out": {}}[cache]
    positions = np.arange(ids.shape[1])[None]
    out = prefill(ids, position_ids=positions, **given, **_statics())
    np.testing.assert_allclose(out["logits"][:, -1], eager, rtol=1e-4, atol=1e-5)
    filled = out["cache"]
    assert len(filled) == 2 and all(k.shape[2] == ids.shape[1] for k, _ in filled)
    token = out["logits"][:, -1:].argmax(-1)
    step = decode(token, cache=filled, position_ids=np.array([[ids.shape[1]]]), **_statics())
    assert step["logits"].shape == (1, 1, 100)


def test_a_decode_graph_still_needs_its_cache(shipped):
    _, decode_path, ids, _ = shipped
    decode = cr.load(decode_path)
    with pytest.raises(GraphInputError, match="cache"):
        decode(ids[:, :1], cache=None, position_ids=np.array([[6]]), **_statics())


def test_inspect_says_how_to_pass_the_cache(shipped, capsys):
    prefill_path, decode_path, _, _ = shipped
    assert main(["inspect", str(prefill_path)]) == 0
    captured = [line for line in capsys.readouterr().out.splitlines() if line.startswith("captured for: ")]
    assert captured and captured[0].endswith(
        ", cache=((), ()) (an empty DynamicCache of 2 layers: a prefill; cache=None or no cache is taken too)")
    assert main(["inspect", str(decode_path)]) == 0
    captured = [line for line in capsys.readouterr().out.splitlines() if line.startswith("captured for: ")]
    assert captured and captured[0].endswith(", cache: DynamicCache of 2 layers, as ((key, value), ...) arrays")
