"""A real HuggingFace model, built tiny from a config (random weights, offline), end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2Model
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

import clika_runtime as cr

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, use_cache=False)
    return GPT2Model(config).eval()


def _inputs(batch, seq):
    ids = torch.randint(0, 100, (batch, seq))
    return ids, torch.ones(batch, seq, dtype=torch.long)


def test_gpt2_compiles_drifts_and_serves_like_eager(gpt2):
    f = cr.compile(gpt2)
    with torch.no_grad():
        for seq in (8, 12, 5, 12):
            ids, mask = _inputs(2, seq)
            got = f(input_ids=ids, attention_mask=mask)
            expected = gpt2(input_ids=ids, attention_mask=mask)
            assert type(got) is BaseModelOutputWithPastAndCrossAttentions
            assert list(got.keys()) == list(expected.keys())
            assert list(vars(got)) == list(vars(expected))  # the same fields, None where eager has None
            assert got.hidden_states is None and got[0] is got.last_hidden_state
            torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-4)
    assert f.state is cr.CompiledFunction.State.Compiled, f.recapture_reasons
    assert f.recapture_count == 1
    assert f.input_names == ["input_ids", "attention_mask"]
    graph = f.take_graph()
    dims = graph.dynamic_axes
    assert dims["input_ids"] == {1: "input_ids_dim1"}
    assert dims["attention_mask"] == {1: "input_ids_dim1"}  # one name for axes the exporter proved equal


def test_bert_drifting_batch_and_sequence_serves_like_eager():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    bert = BertModel(config).eval()
    f = cr.compile(bert)

    def batch(b, s):
        return dict(input_ids=torch.randint(0, 100, (b, s)), attention_mask=torch.ones(b, s, dtype=torch.long),
                    token_type_ids=torch.zeros(b, s, dtype=torch.long))

    with torch.no_grad():
        for b, s in [(2, 8), (2, 12), (3, 12), (1, 5), (4, 1), (2, 9)]:
            inputs = batch(b, s)
            got, expected = f(**inputs), bert(**inputs)
            torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.pooler_output, expected.pooler_output, rtol=1e-4, atol=1e-4)
    assert f.state is cr.CompiledFunction.State.Compiled, f.recapture_reasons
    assert f.input_names == ["input_ids", "attention_mask", "token_type_ids"]
