"""MiniMax-M3 (the study's `MiniMaxAI/MiniMax-M3`, EAGLE-3 2.09x) as its release is laid out: a vision-language
checkpoint, here with one sparse layer in three (an indexer choosing key blocks by cache slot) and routed experts, from
transformers' own MiniMax-M3 classes. Its drafter trains from vLLM's features with the trainer holding the head alone
(`target.placement: served`), is planned from config.json (`estimate --config-only`) and exported with the head read
out of the release's safetensors; the engine decodes the release one row at a time (tests/test_one_row_families.py).
Before, every command refused it at its first load. DeepSeek-V4, whose compressed attention the engine does not
decode, is planned for the served placement alone, exported from its head, and refused by `eval` in one line.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from inference.assets.debug_target import resolve_debug_target
from inference.engine.target import TargetModel, head_target
from train.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def minimax_m3(tmp_path_factory):
    """A directory holding a tiny MiniMax-M3 release (vision tower and all) with the debug targets' byte tokenizer."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

    text = dict(vocab_size=260, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, dense_intermediate_size=128, shared_intermediate_size=32,
                num_local_experts=4, num_experts_per_tok=2, rotary_dim=8, index_n_heads=2, index_head_dim=16,
                index_block_size=8, index_topk_blocks=2, index_local_blocks=1,
                layer_types=["full_attention", "minimax_m3_sparse", "full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=None, eos_token_id=257)
    config = MiniMaxM3VLConfig(text_config=text, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    torch.manual_seed(0)
    directory = str(tmp_path_factory.mktemp("minimax-m3") / "released")
    AutoModelForImageTextToText.from_config(config).save_pretrained(directory)
    source = resolve_debug_target("debug:tiny-llama")
    for path in glob.glob(os.path.join(source, "tok*")) + glob.glob(os.path.join(source, "chat*")):
        shutil.copy(path, directory)
    return directory


def test_the_head_is_read_and_the_release_decodes_one_row_at_a_time(minimax_m3, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    whole = AutoModelForImageTextToText.from_pretrained(minimax_m3)
    head = head_target(minimax_m3, torch.float32, "cpu")
    model = head.model
    assert type(model).__name__ == "MiniMaxM3VLForCausalLM"  # the text model alone, its decoder layers on meta
    assert all(p.is_meta for p in model.get_decoder().layers.parameters())
    assert torch.equal(model.get_input_embeddings().weight, whole.get_input_embeddings().weight)
    assert torch.equal(model.get_output_embeddings().weight, whole.get_output_embeddings().weight)
    assert torch.equal(model.get_decoder().norm.weight, whole.model.language_model.norm.weight)
    info = head.target_info()
    assert (info.hidden_size, info.vocab_size, info.num_layers) == (64, 260, 3)
    meta = TargetModel.from_config(minimax_m3).model
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert TargetModel.from_pretrained(minimax_m3).one_row  # its decoder runs here, one row at a time
    assert cli(["eval", "--target", minimax_m3, "--drafter", "ngram", "--num-prompts", "1", "--max-new-tokens", "8",
                "--out", str(tmp_path / "report.json")]) == 0
    assert cli(["eval", "--target", minimax_m3, "--batch-size", "2", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "--batch-size 2: target family minimax_m3_vl_text decodes one row" in errors[0], errors


def test_a_drafter_is_planned_and_exported_from_the_head(minimax_m3, tmp_path, capsys):
    """`estimate --config-only` plans an EAGLE-3 run on it, and a drafter for it (as a cluster run with vLLM's
    features leaves it) exports in the speculators layout with the head read out of the release's safetensors."""
    from drafters import DRAFTERS
    from train.config import load_recipe

    recipe = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                      {"role": "assistant", "content": "1 2 3 4 5 " * 4}]}) + "\n"
                             for i in range(6)))
    overrides = [f"target.name_or_path={minimax_m3}", f"data.path={chats}", "data.num_samples=null",
                 "data.num_eval_samples=2", f"data.cache_dir={tmp_path / 'datasets'}", "data.max_length=64",
                 "eval.num_prompts=0"]
    assert cli(["estimate", recipe, *overrides, "--world-size", "2", "--config-only"]) == 0
    planned = capsys.readouterr().out
    assert planned.startswith(f"config only: {minimax_m3} read without its weights")
    assert f"target {minimax_m3}: D=64" in planned and "one training step of the drafter" in planned
    # the training forward runs here too (one row per decode is the engine's limit, not the trainer's): any placement
    assert "vLLM only" not in planned and planned.splitlines()[-1].endswith("target.placement: replicated")
    info = head_target(minimax_m3, torch.float32, "cpu").target_info()
    drafter = DRAFTERS["eagle3"](load_recipe(recipe).drafter, info)
    native = str(tmp_path / "drafter")
    drafter.save(native)
    out = str(tmp_path / "speculators")
    assert cli(["export", native, "--format", "speculators", "--out", out, "--target", minimax_m3]) == 0
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    assert exported["speculators_config"]["verifier"]["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]


def test_a_family_the_engine_cannot_decode_is_planned_served_and_exported(tmp_path, capsys):
    """DeepSeek-V4 (compressed attention, which the engine does not roll back; vLLM 0.32 registers it): its drafter
    is planned for `target.placement: served` alone, its head is read with the decoder left on the meta device, and a
    drafter for it exports naming its architecture, while `eval` refuses the target in one line."""
    from test_families import tiny_deepseek_v4
    from transformers import AutoModelForCausalLM

    from drafters import DRAFTERS
    from train.config import load_recipe

    released = str(tmp_path / "released")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_deepseek_v4(vocab_size=260, eos_token_id=257)).save_pretrained(released)
    source = resolve_debug_target("debug:tiny-llama")
    for path in glob.glob(os.path.join(source, "tok*")) + glob.glob(os.path.join(source, "chat*")):
        shutil.copy(path, released)
    recipe = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
    overrides = [f"target.name_or_path={released}", "drafter.layer_ids=[1,2]"]
    assert cli(["estimate", recipe, *overrides, "--config-only"]) == 0
    planned = capsys.readouterr().out.splitlines()
    assert "  (its heavily_compressed_attention layers run in vLLM only: target.placement served)" in planned
    assert planned[-1].endswith("target.placement: served")
    head = head_target(released, torch.float32, "cpu")
    assert all(p.is_meta for p in head.layers.parameters()) and not head.final_norm.weight.is_meta
    native, out = str(tmp_path / "drafter"), str(tmp_path / "speculators")
    DRAFTERS["eagle3"](load_recipe(recipe, overrides[1:]).drafter, head.target_info()).save(native)
    assert cli(["export", native, "--format", "speculators", "--out", out, "--target", released]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["speculators_config"]["verifier"]["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cli(["eval", "--target", released, "--drafter", "ngram", "--num-prompts", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "layer types ['heavily_compressed_attention'] are not supported" in errors[0]
