"""A target whose tokenizer exists only as code it ships (Kimi-K2.5: tokenization_kimi.TikTokenTokenizer over
tiktoken.model, no tokenizer.json). transformers builds a fast tokenizer of its own from such vocabulary files, with
its default pre-tokenizer rather than the shipped code's (Kimi's splits Han script apart and keeps its <think> tokens
whole), so the ids would differ from those the served model sees. draftsmith refuses it in one line before any
weight is read, and runs the shipped code when the user asks for it (target.trust_remote_code, --trust-remote-code).
Here the shipped code is a real tokenizer class written beside a debug target, which reads the debug tokenizer's
vocabulary from a file of its own name and leaves a mark when it runs.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from inference.assets.debug_target import resolve_debug_target
from inference.engine.target_files import load_tokenizer, shipped_tokenizer_code
from train.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASS = "tokenization_shipped.ShippedTokenizer"


@pytest.fixture()
def shipped(tmp_path):
    """(target directory, the file the shipped code creates when it runs)."""
    directory = tmp_path / "target"
    shutil.copytree(resolve_debug_target("debug:tiny-llama"), directory)
    os.rename(directory / "tokenizer.json", directory / "shipped_tokenizer.json")
    with open(directory / "tokenizer_config.json") as f:
        config = json.load(f)
    config.update(tokenizer_class="ShippedTokenizer", auto_map={"AutoTokenizer": [CLASS, None]})
    with open(directory / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    marker = tmp_path / "shipped_code_ran"
    # the model's own code beside it (as Kimi-K2.5 ships configuration_kimi_k25.py), which must never run
    with open(directory / "config.json") as f:
        model_config = json.load(f)
    model_config["auto_map"] = {"AutoConfig": "configuration_shipped.ShippedConfig"}
    with open(directory / "config.json", "w") as f:
        json.dump(model_config, f)
    (directory / "configuration_shipped.py").write_text(f"open({str(tmp_path / 'model_code_ran')!r}, 'w').close()\n")
    vocabulary = str(directory / "shipped_tokenizer.json")
    (directory / "tokenization_shipped.py").write_text(f'''from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


class ShippedTokenizer(PreTrainedTokenizerFast):
    def __init__(self, *args, **kwargs):
        open({str(marker)!r}, "w").close()
        super().__init__(*args, tokenizer_object=Tokenizer.from_file({vocabulary!r}), **kwargs)
''')
    return str(directory), marker


def test_a_shipped_tokenizer_runs_only_when_asked(shipped):
    directory, marker = shipped
    assert shipped_tokenizer_code(directory) == CLASS
    assert shipped_tokenizer_code(resolve_debug_target("debug:tiny-llama")) is None  # a tokenizer.json is read
    with pytest.raises(ValueError, match=r"its tokenizer is code the model ships \(tokenization_shipped"
                                         r".ShippedTokenizer\).*target.trust_remote_code=true") as refused:
        load_tokenizer(directory)
    assert "\n" not in str(refused.value) and not marker.exists()
    tokenizer = load_tokenizer(directory, trust_remote_code=True)
    assert type(tokenizer).__name__ == "ShippedTokenizer" and marker.exists()
    reference = load_tokenizer(resolve_debug_target("debug:tiny-llama"))
    text = "Count to five: 1 2 3 4 5.<|im_end|>"
    assert tokenizer.encode(text) == reference.encode(text)
    assert not os.path.exists(os.path.join(os.path.dirname(directory), "model_code_ran"))  # the model's code never


def test_every_command_refuses_it_in_one_line_and_runs_it_when_asked(shipped, tmp_path, capsys):
    """eval (--trust-remote-code) and the recipe commands (target.trust_remote_code; estimate here) alike: refused in
    one line before the weights load, then run as asked."""
    directory, marker = shipped
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                      {"role": "assistant", "content": "1 2 3 4 5 " * 4}]}) + "\n"
                             for i in range(6)))
    recipe = [os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml"), f"target.name_or_path={directory}",
              f"data.path={chats}", "data.num_samples=null", "data.num_eval_samples=2",
              f"data.cache_dir={tmp_path / 'datasets'}", "data.max_length=64", "eval.num_prompts=0"]
    evaluate = ["eval", "--target", directory, "--drafter", "ngram", "--num-prompts", "1", "--max-new-tokens", "8",
                "--num-draft-tokens", "2", "--out", str(tmp_path / "eval" / "report.json")]
    for argv in (evaluate, ["estimate", *recipe, "--no-probe"]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1 and "trust_remote_code=true" in errors[0] and "Traceback" not in err, errors
        assert not marker.exists()
    assert cli([*evaluate, "--trust-remote-code"]) == 0
    assert marker.exists()
    marker.unlink()
    assert cli(["estimate", *recipe, "target.trust_remote_code=true", "--no-probe"]) == 0
    assert marker.exists()
    assert not (tmp_path / "model_code_ran").exists()  # the tokenizer's code ran, the model's never
