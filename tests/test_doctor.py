"""`draftsmith doctor` on the tiny debug target: a good export passes every check, and broken exports fail naming
the field (EAGLE-3: shifted layer ids, a missing d2t, a wrong hidden size; DFlash: shifted layer ids, a missing mask
token, a wrong hidden size, a text token as mask); bad input gets one line, never a traceback."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from inference.evaluation.eval import render_prompt
from inference.evaluation.prompts import load_questions
from train.doctor import main

TARGET = "debug:tiny-llama"
PROMPTS = str(Path(__file__).parent / "data" / "questions_small.jsonl")


def answered_prompts(target: TargetModel) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """The doctor's five prompts rendered for `target`, and each with the target's greedy answer (48 tokens) as
    right-padded rows: (prompts, input_ids [5, T], mask [5, T])."""
    _, questions = load_questions(PROMPTS, num_prompts=5)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]
    answers = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=48).tokens
    rows = [p + a for p, a in zip(prompts, answers)]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return prompts, ids, mask


def train_steps(drafter, batch: dict, steps: int, lr: float):
    """`steps` AdamW steps of `drafter`'s own loss on one batch."""
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    for step in range(steps):
        loss, _ = drafter.loss(drafter({**batch, "epoch": step}), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter


def overfit(target: TargetModel, drafter, steps: int, lr: float = 1e-2):
    """Train `drafter` (in a few seconds) on the target's own greedy answers to the doctor's prompts, so that its
    acceptance there is far above random weights."""
    _, ids, mask = answered_prompts(target)
    drafter.init_from_data(torch.bincount(ids[mask.bool()], minlength=target.target_info().vocab_size).float())
    features = target.features(ids, mask, drafter.target_layer_ids())
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, "hidden": features.hidden,
             "final_hidden": features.final_hidden, "target_argmax": features.argmax}
    return train_steps(drafter, batch, steps, lr)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """An overfitted EAGLE-3 drafter exported in every format."""
    root = tmp_path_factory.mktemp("doctor")
    target = TargetModel.from_pretrained(TARGET)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 3), draft_vocab_size=128, ttt_steps=2), target.target_info())
    drafter = overfit(target, drafter, steps=40)
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


def test_rope_nested_by_layer_type_is_written_flat_and_a_nested_one_fails_the_vllm_reader(exports, tmp_path,
                                                                                               capsys):
    """A Gemma target's RoPE is nested by layer type in its config; a drafter's config names its own one RoPE (the
    sliding layers'), which vLLM's Llama draft layer needs: an export written nested fails the vLLM reader row."""
    from drafters.layers import rope_parameters

    gemma = {"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.25},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    assert rope_parameters(gemma) == {"rope_type": "default", "rope_theta": 10000.0}
    info = TargetModel.from_pretrained("debug:tiny-gemma4").target_info()
    drafter = Eagle3Drafter(Eagle3Config(layer_ids=(0, 1, 2), draft_vocab_size=64), info)
    drafter.save(str(tmp_path / "gemma"), "speculators")
    written = json.loads((tmp_path / "gemma" / "config.json").read_text())["transformer_layer_config"]
    assert not any(isinstance(value, dict) for value in written["rope_parameters"].values())

    def nest(config):  # what earlier exports of a Gemma target wrote
        config["transformer_layer_config"]["rope_parameters"] = gemma["rope_parameters"]
        return config

    code, out = doctor(capsys, broken_copy(exports, tmp_path, "speculators", edit_config=nest))
    assert code == 1 and check_line(out, "reader vllm").startswith("  FAIL") and "nested by layer type" in out


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


# ---- DFlash (drafters/dflash/readers.py) -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dflash_exports(tmp_path_factory):
    """An overfitted DFlash drafter (full vocabulary, block 4) in the z-lab and speculators layouts, and one with a
    reduced draft vocabulary in the z-lab layout."""
    root = tmp_path_factory.mktemp("doctor_dflash")
    target = TargetModel.from_pretrained(TARGET)
    torch.manual_seed(0)
    config = DFlashConfig(layer_ids=(1, 2, 3), num_layers=1, block_size=4, num_anchors=256)
    drafter = overfit(target, DFlashDrafter(config, target.target_info()), steps=40)
    for fmt in ("dflash", "speculators"):
        drafter.save(str(root / fmt), fmt)
    reduced = DFlashDrafter(dataclasses.replace(config, draft_vocab_size=128), target.target_info())
    reduced.save(str(root / "reduced"), "dflash")
    return root


DFLASH_FIELD_CHECKS = ("layout", "fields", "layer ids", "mask token", "sizes", "draft vocab", "block",
                       "reader draftsmith", "reader vllm")


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_dflash_good_export_passes(dflash_exports, capsys, fmt):
    code, out = doctor(capsys, dflash_exports / fmt)
    assert code == 0, out
    readers = ["dflash", "transformers"] if fmt == "dflash" else ["speculators"]
    for name in DFLASH_FIELD_CHECKS + tuple(f"reader {r}" for r in readers) + ("engine",):
        assert check_line(out, name).startswith("  PASS"), (name, out)
    assert "INFO  reader " + ("speculators" if fmt == "dflash" else "dflash") in out


def test_dflash_reduced_vocab_warns_for_the_zlab_readers(dflash_exports):
    target = TargetModel.from_pretrained(TARGET)
    rows = {row.name: row for row in DFlashDrafter.export_module.export_checks(str(dflash_exports / "reduced"),
                                                                   target.target_info())}
    assert all(rows[name].status == "pass" for name in DFLASH_FIELD_CHECKS), rows
    for reader in ("dflash", "transformers"):  # they always use the target's lm_head
        assert rows[f"reader {reader}"].status == "warn" and "draft_vocab_size: null" in rows[f"reader {reader}"].detail


def test_dflash_shifted_layer_ids_fail_naming_the_field(dflash_exports, tmp_path, capsys):
    def shift(config):  # the classic slip: our ids written where z-lab ids (ours - 1) belong
        config["dflash_config"]["target_layer_ids"] = config["target_layer_ids"] = [1, 2, 3]
        return config

    code, out = doctor(capsys, broken_copy(dflash_exports, tmp_path, "dflash", edit_config=shift))
    assert code == 1
    line = check_line(out, "layer ids")
    assert line.startswith("  FAIL") and "dflash_config.target_layer_ids [1, 2, 3] (= our ids [2, 3, 4])" in line
    assert "disagree with eagle_aux_hidden_state_layer_ids" in line
    assert check_line(out, "reader draftsmith").startswith("  FAIL") and "disagree" in out
    for reader in ("dflash", "transformers"):  # they read the shifted z-lab lists: one layer off
        line = check_line(out, f"reader {reader}")
        assert line.startswith("  FAIL") and "layer_ids (2, 3, 4) (the file means (1, 2, 3))" in line, line
    assert check_line(out, "reader vllm").startswith("  PASS")  # it captures eagle_aux_hidden_state_layer_ids


def test_dflash_missing_mask_token_fails_naming_the_field(dflash_exports, tmp_path, capsys):
    def drop(config):
        del config["dflash_config"]["mask_token_id"], config["mask_token_id"]
        return config

    code, out = doctor(capsys, broken_copy(dflash_exports, tmp_path, "dflash", edit_config=drop))
    assert code == 1
    assert check_line(out, "fields").startswith("  FAIL") and "dflash_config.mask_token_id (the dflash" in out
    assert check_line(out, "mask token").startswith("  FAIL")
    assert "has no default mask_token_id" in check_line(out, "reader dflash")
    assert check_line(out, "reader transformers").startswith("  FAIL") and "mask_token_id 201818" in out
    assert "Traceback" not in out


def test_dflash_wrong_hidden_size_fails(dflash_exports, tmp_path, capsys):
    def widen(config):
        config["transformer_layer_config"]["hidden_size"] = 96
        return config

    code, out = doctor(capsys, broken_copy(dflash_exports, tmp_path, "speculators", edit_config=widen))
    assert code == 1
    assert check_line(out, "sizes").startswith("  FAIL") and "hidden_size 96 != the target's 64" in out


def test_dflash_rope_nested_by_layer_type_fails_the_vllm_reader(dflash_exports, tmp_path, capsys):
    def nest(config):  # what earlier exports for a Gemma target wrote
        config["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
        return config

    code, out = doctor(capsys, broken_copy(dflash_exports, tmp_path, "dflash", edit_config=nest))
    assert code == 1 and check_line(out, "reader vllm").startswith("  FAIL") and "nested by layer type" in out


def test_dflash_text_mask_token_fails(dflash_exports, tmp_path):
    def text_token(config):
        config["mask_token_id"] = 65  # a byte the tokenizer uses for text
        return config

    target = TargetModel.from_pretrained(TARGET)
    rows = {row.name: row for row in DFlashDrafter.export_module.export_checks(
        str(broken_copy(dflash_exports, tmp_path, "speculators", edit_config=text_token)), target.target_info())}
    assert rows["mask token"].status == "fail" and "uses for text" in rows["mask token"].detail
