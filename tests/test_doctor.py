"""`draftsmith doctor` on the tiny debug target: a good export passes every check, and broken exports (shifted layer
ids, a missing d2t, a wrong hidden size) fail naming the field; bad input gets one line, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from inference.eval import render_prompt
from inference.generate import speculative_generate
from inference.prompts import load_questions
from inference.target import TargetModel
from train.doctor import main

TARGET = "debug:tiny-llama"
PROMPTS = str(Path(__file__).parent / "data" / "questions_small.jsonl")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A drafter overfitted (in a few seconds) on the target's own greedy answers to the doctor's prompts, so that
    its acceptance there is far above random weights; exported in every format."""
    root = tmp_path_factory.mktemp("doctor")
    target = TargetModel.from_pretrained(TARGET)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 3), draft_vocab_size=128, ttt_steps=2), target.target_info())
    _, questions = load_questions(PROMPTS, num_prompts=5)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]
    answers = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=48).tokens
    rows = [p + a for p, a in zip(prompts, answers)]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    drafter.init_from_data(torch.bincount(ids[mask.bool()], minlength=target.target_info().vocab_size).float())
    features = target.features(ids, mask, drafter.target_layer_ids())
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, "target_hidden": features.hidden,
             "target_last_hidden": features.last_hidden, "target_argmax": features.argmax}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(40):
        loss, _ = drafter.loss(drafter(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for fmt in ("native", "speculators", "eagle3", "sglang"):
        drafter.save(str(root / fmt), fmt)
    return root


def doctor(capsys, directory, *extra) -> tuple[int, str]:
    code = main([str(directory), "--target", TARGET, "--prompts", PROMPTS, "--max-new-tokens", "24", *extra])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def check_line(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line[8:].startswith(name + " "))


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_good_export_passes(exports, capsys, fmt):
    code, out = doctor(capsys, exports / fmt)
    assert code == 0, out
    for name in ("layout", "fields", "layer ids", "sizes", "draft vocab", "reader draftsmith", "reader vllm",
                 "engine"):
        assert check_line(out, name).startswith("  PASS"), (name, out)
    readers = ["speculators"] if fmt == "speculators" else ["sglang", "specforge"]
    assert all(check_line(out, f"reader {r}").startswith("  PASS") for r in readers), out
    assert "INFO  reader " + ("sglang" if fmt == "speculators" else "speculators") in out


def test_plain_export_warns_about_specforge(exports, capsys):
    code, out = doctor(capsys, exports / "eagle3")
    assert code == 0, out
    specforge = check_line(out, "reader specforge")
    assert specforge.startswith("  WARN") and "--format sglang" in specforge


def broken_copy(exports, tmp_path, fmt, edit_config=None, edit_tensors=None) -> Path:
    directory = tmp_path / f"broken_{fmt}"
    directory.mkdir()
    config = json.loads((exports / fmt / "config.json").read_text())
    tensors = load_file(str(exports / fmt / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    save_file(edit_tensors(tensors) if edit_tensors else tensors, str(directory / "model.safetensors"))
    return directory


def test_shifted_layer_ids_fail_naming_the_field(exports, tmp_path, capsys):
    def shift(config):  # the old bug: nested ids written in vLLM convention
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
        return config

    code, out = doctor(capsys, broken_copy(exports, tmp_path, "sglang", edit_config=shift))
    assert code == 1
    line = check_line(out, "layer ids")
    assert line.startswith("  FAIL") and "eagle_config.eagle_aux_hidden_state_layer_ids" in line


def test_missing_d2t_fails(exports, tmp_path, capsys):
    code, out = doctor(capsys, broken_copy(exports, tmp_path, "speculators",
                                           edit_tensors=lambda t: {k: v for k, v in t.items() if k != "d2t"}))
    assert code == 1
    assert check_line(out, "draft vocab").startswith("  FAIL") and "no d2t" in out


def test_wrong_hidden_size_fails(exports, tmp_path, capsys):
    def widen(config):
        config["transformer_layer_config"]["hidden_size"] = 96
        return config

    code, out = doctor(capsys, broken_copy(exports, tmp_path, "speculators", edit_config=widen))
    assert code == 1
    assert check_line(out, "sizes").startswith("  FAIL") and "hidden_size 96 != the target's 64" in out
    assert "Traceback" not in out


def test_random_weights_fail_the_engine_check(tmp_path, capsys):
    target = TargetModel.from_pretrained(TARGET)
    torch.manual_seed(0)
    Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 3), draft_vocab_size=128), target.target_info()).save(
        str(tmp_path), "speculators")
    code, out = doctor(capsys, tmp_path)
    assert code == 1 and check_line(out, "engine").startswith("  FAIL") and "random weights" in out


@pytest.mark.parametrize("argv,message", [
    (["/nonexistent/drafter", "--target", TARGET], "no config.json"),
    (["{exports}/speculators", "--target", "/nonexistent/target"], "target '/nonexistent/target'"),
    (["{exports}/speculators", "--target", TARGET, "--prompts", "/nonexistent.jsonl"], "nonexistent.jsonl"),
    (["{exports}/speculators", "--target", TARGET, "--num-draft-tokens", "0"], "--num-draft-tokens"),
])
def test_bad_input_is_one_line(exports, capsys, argv, message):
    code = main([a.replace("{exports}", str(exports)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
