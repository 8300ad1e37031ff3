"""Chat-template options reach every rendering (inference/evaluation/chat_template.py): training data and its loss
mask, regeneration, the training probe's prompts, `draftsmith eval` / `calibrate` / `doctor`, with a tiny template that
branches on enable_thinking; bad options are one-line errors; the Qwen3 recipes turn thinking off.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from offline_tokenizers import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from inference.evaluation.chat_template import (check_template_kwargs, parse_template_kwargs, render_prompt,
                                                render_text, thinking_mismatch, trained_mode_mismatch)
from train.cli import main as cli
from train.config import load_recipe, save_recipe
from train.data.chat import tokenize_conversation
from train.data.dataset import DataConfig, build_dataset
from train.data.regenerate import RegenerateConfig, regenerate
from train.fit.metrics import load_eval_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF = {"enable_thinking": False}
# Qwen3.5-style: thinking on by default (the generation prompt opens a think block); with enable_thinking false the
# generation prompt and every assistant turn carry an empty, closed think block.
THINKING_TEMPLATE = (
    "{% set off = enable_thinking is defined and enable_thinking is false %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and off %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if off %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tokenizer("chatml")
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def test_the_option_switches_the_generation_prompt(tokenizer):
    on = tokenizer.decode(render_prompt(tokenizer, ["Hi"], [], True))
    off = tokenizer.decode(render_prompt(tokenizer, ["Hi"], [], True, OFF))
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("assistant\n<think>\n\n</think>\n\n")
    assert render_prompt(tokenizer, ["Hi"], [], False, OFF) == render_prompt(tokenizer, ["Hi"], [], False)


def test_training_data_renders_in_the_mode_and_trains_only_the_answer(tokenizer, tmp_path):
    sample = tokenize_conversation(tokenizer, CHAT, 512, template_kwargs=OFF)
    text = tokenizer.decode(sample["input_ids"])
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nParis" in text
    trained = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
    assert trained == "Paris is the capital of France.<|im_end|>"  # the injected block is rendered, not trained
    assert "<think>" not in tokenizer.decode(tokenize_conversation(tokenizer, CHAT, 512)["input_ids"])
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": CHAT}) + "\n" for i in range(4)))
    texts = {}
    for name, options in (("on", {}), ("off", OFF)):  # same source and cache: the option is in the fingerprint
        config = DataConfig(path=str(path), num_eval_samples=0, cache_dir=str(tmp_path / "cache"),
                            chat_template_kwargs=options)
        texts[name] = tokenizer.decode(build_dataset(tokenizer, config).train[0]["input_ids"])
    assert "<think>" in texts["off"] and "<think>" not in texts["on"]


def test_regeneration_answers_the_prompt_rendered_in_the_mode(tokenizer, tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    out = tmp_path / "regenerated.jsonl"
    regenerate(model, tokenizer, [{"id": "a", "messages": CHAT}], str(out), RegenerateConfig(max_new_tokens=8),
               template_kwargs=OFF)
    answer = json.loads(out.read_text())["messages"][1]["content"]
    # The greedy continuation of the thinking-off prompt, computed here without draftsmith.
    text = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)[0, prompt.shape[1]:]
    assert answer == tokenizer.decode(expected, skip_special_tokens=True).strip()
    with pytest.raises(ValueError, match="data.chat_template_kwargs: the chat template never reads 'enable_thinkng'"):
        regenerate(model, tokenizer, [{"id": "b", "messages": CHAT}], str(out), RegenerateConfig(),
                   template_kwargs={"enable_thinkng": 0})


def test_an_answer_that_thinks_with_thinking_off_is_a_mismatch():
    assert thinking_mismatch("<think>\nhmm</think>Paris", OFF) is not None
    assert thinking_mismatch("Paris", OFF) is None
    assert thinking_mismatch("<think>\nhmm</think>Paris", {}) is None  # thinking on (or not asked for): any answer


def test_the_training_probe_renders_with_the_recipe_options(tokenizer):
    on, off = (load_eval_prompts(tokenizer, "mt_bench", 2, template_kwargs=options) for options in ({}, OFF))
    assert [tokenizer.decode(ids).endswith("</think>\n\n") for ids in off] == [True, True]
    assert [tokenizer.decode(ids).endswith("<think>\n") for ids in on] == [True, True]


def test_bad_options_are_refused_naming_them(tokenizer):
    assert parse_template_kwargs("enable_thinking=false, budget=3") == {"enable_thinking": False, "budget": 3}
    for text in ("enable_thinking", "=1", "a b=1", "x=[1]", "x=[1, 2]", "x=null"):
        with pytest.raises(ValueError, match="--chat-template-kwargs: "):
            parse_template_kwargs(text)
    with pytest.raises(ValueError, match="where: 'messages' is set by draftsmith itself"):
        check_template_kwargs(THINKING_TEMPLATE, {"messages": []}, "where")
    with pytest.raises(ValueError, match=r"never reads 'thinking'.*options are \['enable_thinking'\]"):
        check_template_kwargs(THINKING_TEMPLATE, {"thinking": False}, "where")
    assert render_text(tokenizer, CHAT, template_kwargs=OFF).count("</think>") == 1


@pytest.mark.parametrize("command", ["eval", "calibrate", "doctor"])
def test_commands_refuse_an_option_the_template_ignores_in_one_line(command, tmp_path, capsys):
    tail = {"eval": ["--drafter", "ngram", "--out", str(tmp_path / "r.json")],
            "calibrate": ["--out", str(tmp_path / "c")], "doctor": []}[command]
    head = [command] if command == "eval" else [command, str(tmp_path)]
    kind = "dspark" if command == "calibrate" else "eagle3"  # calibrate refuses a kind it cannot calibrate first
    (tmp_path / "config.json").write_text(json.dumps({"draftsmith_kind": kind}))
    argv = head + ["--target", "debug:tiny-llama", "--chat-template-kwargs", "enable_thinking=false"] + tail
    assert cli(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]  # beside transformers' progress bars
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"draftsmith {command}: error: --chat-template-kwargs: the chat template never reads "
                               "'enable_thinking'"), lines
    assert cli(["eval", "--target", "debug:tiny-llama", "--chat-template-kwargs", "oops"]) == 2
    assert "--chat-template-kwargs: expected comma-separated name=value pairs" in capsys.readouterr().err


def test_qwen3_recipes_turn_thinking_off_everywhere():
    recipes = sorted(glob.glob(os.path.join(ROOT, "recipes", "qwen3-8b", "*.yaml")))
    assert recipes
    for path in recipes:
        assert load_recipe(path).data.chat_template_kwargs == OFF, path


def test_eval_names_a_drafter_trained_in_another_mode(tmp_path):
    save_recipe(load_recipe(os.path.join(ROOT, "recipes", "qwen3-8b", "eagle3.yaml")), str(tmp_path / "recipe.yaml"))
    warning = trained_mode_mismatch(str(tmp_path), {})
    assert warning and warning.endswith("pass --chat-template-kwargs enable_thinking=false to serve it in its "
                                        "training mode")
    assert trained_mode_mismatch(str(tmp_path), OFF) is None
    assert trained_mode_mismatch(str(tmp_path / "nothing"), {}) is None  # no recipe saved: nothing to compare

