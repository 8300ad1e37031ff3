"""Prompt-set parsing and selection, target resolution, truncated draft models; the real SmolLM2 conversion is slow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.assets.store import (
    COMPLETE_MARKER, SMOLLM2_NAME, ensure_smollm2, is_complete, make_truncated_draft_model, resolve_target,
)
from inference.evaluation.prompts import Question, builtin_prompt_sets, load_questions, select_spread
from conftest import make_tiny_model

DATA = Path(__file__).parent / "data"


def test_small_file_parses_with_two_turn_questions():
    name, questions = load_questions(str(DATA / "questions_small.jsonl"))
    assert name == "questions_small"
    assert [q.question_id for q in questions] == [1, 2, 3, 4, 5]  # the blank line is skipped
    assert [len(q.turns) for q in questions] == [2, 1, 2, 1, 1]
    assert questions[1] == Question(2, "math", ["What is 17 multiplied by 23? Show your steps."])


@pytest.mark.parametrize("line, fault", [
    ('{"question_id": 9, "turns": ["a"', "invalid JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"category": "x", "turns": ["a"]}', "missing 'question_id'"),
    ('{"question_id": 9, "category": "x"}', "missing 'turns'"),
    ('{"question_id": 9, "turns": []}', "at least one non-empty string"),
    ('{"question_id": 9, "turns": ["ok", "  "]}', "at least one non-empty string"),
    ('{"question_id": 9, "turns": "just a string"}', "list of strings"),
    ('{"question_id": 9, "turns": ["a", 3]}', "list of strings"),
    ('{"question_id": 9, "category": 5, "turns": ["a"]}', "'category' must be a string"),
    ('{"question_id": 1, "turns": ["again"]}', "duplicate question_id 1"),
])
def test_malformed_line_names_file_line_and_fault(tmp_path, line, fault):
    path = tmp_path / "bad.jsonl"
    good = '{"question_id": 1, "category": "x", "turns": ["fine"]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ValueError) as error:
        load_questions(str(path))
    assert f"{path}:3:" in str(error.value) and fault in str(error.value)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_set"):
        load_questions(str(tmp_path / "no_such_set.jsonl"))
    with pytest.raises(FileNotFoundError, match="neither a builtin"):
        load_questions("mt_bench_typo")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no questions"):
        load_questions(str(tmp_path / "empty.jsonl"))


def test_missing_category_defaults_and_fastchat_folder_name(tmp_path):
    folder = tmp_path / "alpaca"
    folder.mkdir()
    (folder / "question.jsonl").write_text('{"question_id": 0, "category": "", "turns": ["hi"]}\n')
    name, questions = load_questions(str(folder / "question.jsonl"))
    assert name == "alpaca" and questions[0].category == "general"


@pytest.mark.parametrize("name, count, num_categories, max_turns", [
    ("mt_bench", 80, 8, 2), ("gsm8k", 80, 1, 1), ("humaneval", 80, 1, 1), ("spec_bench", 480, 13, 2),
])
def test_builtin_sets_load(name, count, num_categories, max_turns):
    assert name in builtin_prompt_sets()
    dataset, questions = load_questions(name)
    assert dataset == name and len(questions) == count
    assert len({q.category for q in questions}) == num_categories
    assert max(len(q.turns) for q in questions) == max_turns


def test_num_prompts_spreads_over_categories_deterministically():
    _, questions = load_questions("spec_bench", num_prompts=13)
    assert len({q.category for q in questions}) == 13
    _, again = load_questions("spec_bench", num_prompts=13)
    assert again == questions
    _, questions = load_questions("spec_bench", num_prompts=30)
    counts = [sum(q.category == c for q in questions) for c in {q.category for q in questions}]
    assert len(questions) == 30 and max(counts) - min(counts) <= 1
    positions = [q.question_id for q in questions]
    _, everything = load_questions("spec_bench")
    order = [q.question_id for q in everything]
    assert positions == sorted(positions, key=order.index)  # file order is kept
    assert len(load_questions("gsm8k", num_prompts=1000)[1]) == 80


def test_select_spread_when_a_category_runs_out():
    questions = [Question(i, "a" if i < 2 else "b", ["q"]) for i in range(8)]  # a: 2 questions, b: 6
    assert [q.question_id for q in select_spread(questions, 5)] == [0, 1, 2, 3, 4]
    assert [q.question_id for q in select_spread(questions, 3)] == [0, 1, 2]


def test_categories_filter_and_errors():
    _, questions = load_questions("mt_bench", num_prompts=4, categories=["math", "coding"])
    assert sorted(q.category for q in questions) == ["coding", "coding", "math", "math"]
    with pytest.raises(ValueError, match="unknown categories"):
        load_questions("mt_bench", categories=["math", "poetry"])
    with pytest.raises(ValueError, match="num_prompts"):
        load_questions("mt_bench", num_prompts=0)


def test_resolve_target_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_target(str(tmp_path))
    (tmp_path / "model.gguf").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_target(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="never downloads"):
        resolve_target("meta-llama/Llama-3.1-8B-Instruct")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(str(tmp_path)) == str(tmp_path)


def test_truncated_draft_model_equals_target_prefix(tmp_path):
    target = make_tiny_model("llama", num_layers=3, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    out_dir = make_truncated_draft_model(str(tmp_path / "target"), 2, str(tmp_path / "draft"))
    assert is_complete(out_dir) and not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dir left
    draft = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == target.config.vocab_size
    input_ids = torch.tensor([[5, 17, 42, 9, 100]])  # [1, T]
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states[2]  # residual entering layer 2
        expected = target.lm_head(target.model.norm(hidden))  # [1, T, V]
        torch.testing.assert_close(draft(input_ids).logits, expected)
    with pytest.raises(ValueError, match="num_layers must be in 1..3"):
        make_truncated_draft_model(str(tmp_path / "target"), 4, str(tmp_path / "draft4"))


@pytest.mark.slow
def test_smollm2_converts_with_chatml_and_truncates():
    """Uses the real cache ($DRAFTSMITH_CACHE or ~/.cache/draftsmith); converts once (~45 s), then is reused."""
    from transformers import AutoTokenizer

    model_dir = resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert model_dir == ensure_smollm2() and os.path.basename(model_dir) == SMOLLM2_NAME
    assert json.loads(Path(model_dir, COMPLETE_MARKER).read_text())["dtype"] == "float32"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads(Path(model_dir, "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config and config["num_hidden_layers"] == 30
    draft_dir = make_truncated_draft_model(model_dir, 2, f"{model_dir}-draft-L2")
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == 49152
    assert draft.get_output_embeddings().weight.data_ptr() == draft.get_input_embeddings().weight.data_ptr()
    assert AutoTokenizer.from_pretrained(draft_dir).get_vocab() == tokenizer.get_vocab()
