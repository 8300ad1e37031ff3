"""`draftsmith doctor` on native MTP: a target checkpoint with MTP modules in its family's layout (an export, `--format
qwen3_5 / mimo / ...`, or `native-mtp`, the target's own). An overfitted MTP exported into tiny Qwen3.5's layout
passes every row; a wrong module count, a missing tensor and a config vLLM routes to no MTP model each fail their row,
naming the field; `native-mtp` on a target without MTP modules is one line before anything loads."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import edit_config
from safetensors.torch import load_file, save_file

from drafters.mtp import MTPConfig, MTPDrafter
from inference.engine.target import TargetModel
from tests.test_doctor import PROMPTS, check_line, overfit
from train.doctor import main

QWEN = "debug:tiny-qwen3.5"


def doctor(capsys, drafter: str, target: str) -> tuple[int, str]:
    code = main([drafter, "--target", target, "--prompts", PROMPTS, "--max-new-tokens", "24"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def qwen_export(tmp_path_factory):
    """The tiny Qwen3.5 target's own MTP module, overfitted on its answers and exported back into its layout."""
    target = TargetModel.from_pretrained(QWEN)
    torch.manual_seed(0)
    drafter = MTPDrafter(MTPConfig(layout="qwen3_5", init_from_native=True, reuse=True, num_steps=2),
                         target.target_info())
    directory = str(tmp_path_factory.mktemp("mtp") / "served")
    overfit(target, drafter, steps=40, lr=3e-3).save(directory, "qwen3_5")
    return directory


def edited_copy(source: str, directory, config_edit=None, tensors_edit=None) -> str:
    shutil.copytree(source, directory)
    if config_edit:
        edit_config(directory, config_edit)
    if tensors_edit:  # the MTP shard and the index alike
        path, index_path = os.path.join(directory, "model-mtp.safetensors"), os.path.join(
            directory, "model.safetensors.index.json")
        tensors = load_file(path)
        tensors_edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"] = {name: file for name, file in index["weight_map"].items()
                               if file != "model-mtp.safetensors" or name in tensors}
        with open(index_path, "w") as f:
            json.dump(index, f)
    return str(directory)


def test_an_overfitted_export_passes_every_row(qwen_export, capsys, monkeypatch):
    from drafters.mtp import export

    reads, read_native = [], export.read_native
    monkeypatch.setattr(export, "read_native", lambda *args: reads.append(args[0]) or read_native(*args))
    code, out = doctor(capsys, qwen_export, QWEN)
    assert code == 0, out
    assert reads == [qwen_export]  # the sizes row's tensors are the drafter's: a module of many GB is read once
    for name in ("layout", "count", "server", "sizes", "engine"):
        assert check_line(out, name).startswith("  PASS"), (name, out)
    assert "qwen3_5: 1 MTP module(s)" in out and "vLLM maps model_type qwen3_5_text" in out


def test_a_wrong_count_and_a_missing_tensor_fail_their_rows(qwen_export, tmp_path, capsys):
    counted = edited_copy(qwen_export, tmp_path / "count", config_edit=lambda c: c.update(mtp_num_hidden_layers=2))
    code, out = doctor(capsys, counted, QWEN)
    assert code == 1 and check_line(out, "count").startswith("  FAIL"), out
    assert "mtp_num_hidden_layers is 2 but the checkpoint holds 1 module(s)" in out
    missing = edited_copy(qwen_export, tmp_path / "missing",
                          tensors_edit=lambda t: t.pop("mtp.layers.0.mlp.down_proj.weight"))
    code, out = doctor(capsys, missing, QWEN)
    sizes = check_line(out, "sizes")
    assert code == 1 and sizes.startswith("  FAIL") and "missing ['layers.0.block.mlp.down_proj.weight']" in sizes


def test_a_config_vllm_routes_to_no_mtp_model_fails_the_server_row(tmp_path, capsys):
    """MiMo's layout on a Llama target: vLLM picks its MiMo MTP model by architectures[0] alone."""
    target = TargetModel.from_pretrained("debug:tiny-llama")
    MTPDrafter(MTPConfig(layout="mimo"), target.target_info()).save(str(tmp_path / "mimo"), "mimo")
    code, out = doctor(capsys, str(tmp_path / "mimo"), "debug:tiny-llama")
    server = check_line(out, "server")
    assert code == 1 and check_line(out, "layout").startswith("  PASS") and server.startswith("  FAIL"), out
    assert "architectures[0] 'LlamaForCausalLM'" in server and "architectures[0] MiMoForCausalLM" in server


def test_native_mtp_on_a_target_without_modules_is_one_line(capsys):
    code = main(["native-mtp", "--target", "debug:tiny-llama", "--prompts", PROMPTS])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "holds no MTP modules" in err, err
