"""TargetModel.features serves what the full CausalLM forward gives, without materialising [B, T, V] logits."""

from __future__ import annotations

import torch
from conftest import make_tiny_model

import inference.engine.target
from inference.engine.target import TargetModel


def _reference(model, input_ids, attention_mask):
    """Naive reference: every HF hidden state and the full logits of one forward."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return out.hidden_states, out.logits


def test_features_without_logits_equal_the_full_forward(monkeypatch):
    model = make_tiny_model("llama", num_layers=3, dtype=torch.float32)
    target = TargetModel(model)
    torch.manual_seed(0)
    input_ids = torch.randint(3, 256, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # right padding
    monkeypatch.setattr(inference.engine.target, "LOGIT_CHUNK_VALUES", 256 * 5)  # 5 positions per chunk: 7 chunks of 33
    features = target.features(input_ids, attention_mask, (0, 2, 3))
    with torch.no_grad():
        hidden_states, logits = _reference(model, input_ids, attention_mask)
    assert features.logits is None
    for layer_id in (0, 2):
        torch.testing.assert_close(features.hidden[layer_id], hidden_states[layer_id], rtol=0, atol=0)
    assert torch.equal(features.argmax, logits.argmax(-1))
    torch.testing.assert_close(features.final_hidden, hidden_states[3], rtol=0, atol=0)  # HF's last entry is normed
    with_logits = target.features(input_ids, attention_mask, (0, 2, 3), return_logits=True)
    assert torch.equal(with_logits.logits, logits) and torch.equal(with_logits.argmax, features.argmax)
    torch.testing.assert_close(with_logits.hidden[3], features.hidden[3], rtol=0, atol=0)


def test_pad_id_and_feature_dtype_have_one_rule(tiny_target):
    """Training, prepare and estimate read the pad id and the cache dtype from TargetModel: the tokenizer's pad id or
    0, and features.dtype "auto" = the dtype the target computes in."""
    assert tiny_target.pad_token_id == 0  # no tokenizer
    tiny_target.tokenizer = type("Tok", (), {"pad_token_id": 7})()
    assert tiny_target.pad_token_id == 7
    tiny_target.tokenizer.pad_token_id = None
    assert tiny_target.pad_token_id == 0
    assert tiny_target.feature_dtype("auto") == torch.float64  # the tiny targets compute in float64
    assert tiny_target.feature_dtype("bfloat16") == torch.bfloat16
