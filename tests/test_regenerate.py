"""Regeneration of assistant turns by the target: output format, turn-by-turn answers, resume, limits."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from offline_tokenizers import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from train.conversations import normalise_record
from train.data import DataConfig, build_dataset
from train.regenerate import regenerate


def _tiny_model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def _conversations():
    def chat(index, num_turns, system=False):
        messages = [{"role": "system", "content": "Be brief."}] if system else []
        for turn in range(num_turns):
            messages += [{"role": "user", "content": f"question {index}.{turn}"},
                         {"role": "assistant", "content": "an old answer"}]
        return {"id": f"c{index}", "messages": messages}

    return [chat(0, 1), chat(1, 3, system=True), chat(2, 2), chat(3, 1), chat(4, 2, system=True)]


@pytest.fixture(scope="module")
def target():
    tokenizer = build_tokenizer("chatml")
    return _tiny_model(tokenizer), tokenizer


def _read(path):
    with open(path) as stream:
        return [json.loads(line) for line in stream]


def test_regenerated_file_is_well_formed(target, tmp_path):
    model, tokenizer = target
    out = tmp_path / "regen.jsonl"
    stats = regenerate(model, tokenizer, _conversations(), str(out), max_new_tokens=6, batch_size=2)
    records = _read(out)
    assert [r["id"] for r in records] == [c["id"] for c in _conversations()] and stats["conversations"] == 5
    assert stats["generated_tokens"] > 0 and stats["tokens_per_second"] > 0
    for record, original in zip(records, _conversations()):
        messages, reason = normalise_record(record, "openai")
        assert reason == "" and messages == record["messages"]
        users = [m["content"] for m in original["messages"] if m["role"] == "user"]
        assert [m["content"] for m in messages if m["role"] == "user"] == users  # every turn answered in order
        assert all(m["content"] != "an old answer" for m in messages)
        assert (messages[0]["role"] == "system") == (original["messages"][0]["role"] == "system")
    data = build_dataset(tokenizer, DataConfig(path="sharegpt", regenerated_path=str(out), num_eval_samples=0,
                                               cache_dir=str(tmp_path / "cache")))
    assert data.counts["records"] == 5 and data.counts["train"] == 5


def test_resume_skips_done_ids_and_matches_an_uninterrupted_run(target, tmp_path):
    model, tokenizer = target
    sampling = dict(max_new_tokens=6, batch_size=2, temperature=1.0, top_p=0.9, seed=3)
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    regenerate(model, tokenizer, _conversations(), str(full), **sampling)
    lines = full.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:2]) + lines[2][:10])  # first group written, then a crash mid-record
    stats = regenerate(model, tokenizer, _conversations(), str(resumed), **sampling)
    assert stats["conversations"] == 3
    assert resumed.read_text() == full.read_text()
    assert regenerate(model, tokenizer, _conversations(), str(resumed), **sampling)["conversations"] == 0


def test_prompt_limit_stops_a_conversation(target, tmp_path):
    model, tokenizer = target
    out = tmp_path / "short.jsonl"
    regenerate(model, tokenizer, _conversations()[:2], str(out), max_new_tokens=4, max_prompt_tokens=40)
    first, second = _read(out)
    assert [m["role"] for m in first["messages"]] == ["user"]  # kept, unanswered: trains nothing, counted later
    assert [m["role"] for m in second["messages"]] == ["system", "user"]


def test_bad_arguments(target, tmp_path):
    model, tokenizer = target
    with pytest.raises(ValueError, match="unique"):
        regenerate(model, tokenizer, _conversations()[:1] * 2, str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="no chat template"):
        regenerate(model, build_tokenizer(None), _conversations(), str(tmp_path / "x.jsonl"))
    (tmp_path / "junk.jsonl").write_text("not a record\n")
    with pytest.raises(ValueError, match="not a regenerated record"):
        regenerate(model, tokenizer, _conversations(), str(tmp_path / "junk.jsonl"))
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match="vllm is not installed"):
            regenerate(model, tokenizer, _conversations(), str(tmp_path / "x.jsonl"), use_vllm=True)
