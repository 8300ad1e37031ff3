"""Regeneration of assistant turns by the target: output format, turn-by-turn answers, resume, limits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from offline_tokenizers import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from train.data.conversations import normalise_record
from train.data.dataset import DataConfig, build_dataset
from train.data.regenerate import RegenerateConfig, regenerate


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
    stats = regenerate(model, tokenizer, _conversations(), str(out), RegenerateConfig(max_new_tokens=6, batch_size=2))
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
    sampling = RegenerateConfig(max_new_tokens=6, batch_size=2, temperature=1.0, top_p=0.9, seed=3)
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    regenerate(model, tokenizer, _conversations(), str(full), sampling)
    lines = full.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:2]) + lines[2][:10])  # first group written, then a crash mid-record
    stats = regenerate(model, tokenizer, _conversations(), str(resumed), sampling)
    assert stats["conversations"] == 3
    assert resumed.read_text() == full.read_text()
    assert regenerate(model, tokenizer, _conversations(), str(resumed), sampling)["conversations"] == 0


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"min_p": 0.999}])
def test_top_k_and_min_p_reach_the_sampler(target, tmp_path, knob):
    """top_k 1 (or min_p near 1) leaves only the argmax, so sampling at temperature 1 gives the greedy answers."""
    model, tokenizer = target
    greedy, narrowed = tmp_path / "greedy.jsonl", tmp_path / "narrowed.jsonl"
    regenerate(model, tokenizer, _conversations()[:3], str(greedy), RegenerateConfig(max_new_tokens=6, temperature=0.0))
    regenerate(model, tokenizer, _conversations()[:3], str(narrowed),
               RegenerateConfig(max_new_tokens=6, temperature=1.0, seed=5, **knob))
    assert narrowed.read_text() == greedy.read_text()
    wide = tmp_path / "wide.jsonl"
    regenerate(model, tokenizer, _conversations()[:3], str(wide),
               RegenerateConfig(max_new_tokens=6, temperature=1.0, seed=5))
    assert wide.read_text() != greedy.read_text()  # without the knob, temperature 1 does sample


def test_prompt_limit_stops_a_conversation(target, tmp_path):
    model, tokenizer = target
    out = tmp_path / "short.jsonl"
    regenerate(model, tokenizer, _conversations()[:2], str(out),
               RegenerateConfig(max_new_tokens=4, max_prompt_tokens=40))
    first, second = _read(out)
    assert [m["role"] for m in first["messages"]] == ["user"]  # kept, unanswered: trains nothing, counted later
    assert [m["role"] for m in second["messages"]] == ["system", "user"]


def test_bad_arguments(target, tmp_path):
    model, tokenizer = target
    with pytest.raises(ValueError, match="unique"):
        regenerate(model, tokenizer, _conversations()[:1] * 2, str(tmp_path / "x.jsonl"), RegenerateConfig())
    with pytest.raises(ValueError, match="no chat template"):
        regenerate(model, build_tokenizer(None), _conversations(), str(tmp_path / "x.jsonl"), RegenerateConfig())
    for bad, field in (({"top_k": -1}, "regenerate.top_k"), ({"min_p": 1.0}, "regenerate.min_p"),
                       ({"top_p": 0.0}, "regenerate.top_p"), ({"temperature": -0.5}, "regenerate.temperature")):
        with pytest.raises(ValueError, match=field):
            regenerate(model, tokenizer, _conversations(), str(tmp_path / "x.jsonl"), RegenerateConfig(**bad))
    (tmp_path / "junk.jsonl").write_text("not a record\n")
    with pytest.raises(ValueError, match="not a regenerated record"):
        regenerate(model, tokenizer, _conversations(), str(tmp_path / "junk.jsonl"), RegenerateConfig())
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match="vllm is not installed"):
            regenerate(model, tokenizer, _conversations(), str(tmp_path / "x.jsonl"), RegenerateConfig(use_vllm=True))


def _share_recipe(tmp_path, out_name):
    from train.config import load_recipe

    chats = tmp_path / "chats.jsonl"
    if not chats.exists():
        chats.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "debug" / "tiny_eagle3.yaml")
    return load_recipe(recipe, [f"data.path={chats}", f"data.regenerated_path={tmp_path / out_name}",
                                "regenerate.num_conversations=5", "regenerate.max_new_tokens=6",
                                "regenerate.batch_size=1", "regenerate.seed=4"])


def test_sharded_regeneration_resumes_and_merges_to_the_one_process_answers(target, tmp_path):
    """Two processes each answer every second conversation of the seeded sample into their own part; a part cut
    off mid-record resumes where it stopped; the merge equals one process's answers (greedy); a later run with
    three processes finds everything merged and answers nothing."""
    from train.regeneration import merge_parts, part_paths, regenerate_share

    model, tokenizer = target
    one = _share_recipe(tmp_path, "one.jsonl")
    assert regenerate_share(one, model, tokenizer, 0, 1)["conversations"] == 5
    two = _share_recipe(tmp_path, "two.jsonl")
    parts = part_paths(two.data.regenerated_path, 2)
    assert [regenerate_share(two, model, tokenizer, rank, 2)["conversations"] for rank in (0, 1)] == [3, 2]
    complete = Path(parts[0]).read_text()
    Path(parts[0]).write_text(complete.splitlines(keepends=True)[0] + complete.splitlines()[1][:15])  # crash
    assert regenerate_share(two, model, tokenizer, 0, 2)["conversations"] == 2
    assert Path(parts[0]).read_text() == complete
    merge_parts(two.data.regenerated_path, parts)
    merge_parts(two.data.regenerated_path, parts)  # a repeated merge adds nothing
    by_id = {record["id"]: record for record in _read(one.data.regenerated_path)}
    merged = _read(two.data.regenerated_path)
    assert len(merged) == 5 and {record["id"]: record for record in merged} == by_id
    three = _share_recipe(tmp_path, "two.jsonl")
    assert [regenerate_share(three, model, tokenizer, rank, 3)["conversations"] for rank in range(3)] == [0, 0, 0]


def test_vllm_requested_without_vllm_is_one_clear_error(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from accelerate import PartialState

    from train.regeneration import regeneration_model

    recipe = _share_recipe(tmp_path, "x.jsonl")
    recipe.regenerate.use_vllm = True
    with pytest.raises(ValueError, match="regenerate.use_vllm is true but vllm is not importable"):
        regeneration_model(recipe, PartialState(cpu=True))
