"""Targets released as vision-language checkpoints: Gemma 4's (`gemma4`, which transformers' AutoModelForCausalLM
loads as Gemma4ForConditionalGeneration, vision tower and all), Qwen3.5 / 3.6's (`qwen3_5`, and `qwen3_5_moe` as
Qwen3.6-35B-A3B's, which it loads as the text model) and Kimi-K2.5's (`kimi_k25`, a DeepSeek-V3 text model, which
AutoModelForCausalLM does not map at all). Each is written here from a debug target's own weights beside a one-layer
vision tower, as the released files lay them out: the text model under `model.language_model.`, or for Kimi-K2.5
under `language_model.` before its own names (`language_model.model.layers.0...`, `language_model.lm_head.weight`). The
engine, training, the head-only placements and export see the text model alone (inference/engine/target_files.py
`language_model`, `checkpoint_key`), with the debug target's exact logits, head and speculative rounds (n-gram, and
Qwen3.5's native MTP module, kept at the top level of the checkpoint as `mtp.*`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from drafters import NgramDrafter, load_drafter
from inference.assets.debug_target import DEBUG_TARGETS, resolve_debug_target
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel, head_target
from train.cli import main as cli

PROMPTS = [list(range(30, 50)), list(range(100, 109))]  # past the window of 16 within 24 new tokens


# the released model each test writes -> the debug target whose text model it holds
RELEASES = {"tiny-gemma4-moe": "tiny-gemma4-moe", "tiny-qwen3.5": "tiny-qwen3.5",
            "tiny-qwen3.5-moe": "tiny-qwen3.5-moe", "tiny-kimi-k2.5": "tiny-deepseek-v3"}


def vision_language_config(name: str, text: dict):
    if name == "tiny-kimi-k2.5":
        from transformers import Kimi_K25Config

        return Kimi_K25Config(text_config=text, tie_word_embeddings=False, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, pos_emb_height=4,
            pos_emb_width=4))
    if name.startswith("tiny-gemma4"):
        from transformers import Gemma4Config, Gemma4VisionConfig

        vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=16)
        return Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=None,
                            tie_word_embeddings=False)
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    family = Qwen3_5MoeConfig if name.endswith("-moe") else Qwen3_5Config
    return family(text_config=text, tie_word_embeddings=False,
                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))


@pytest.fixture(scope="module", params=sorted(RELEASES))
def released(request, tmp_path_factory):
    """(debug target name, a directory holding it as a vision-language checkpoint)."""
    from transformers import AutoModelForImageTextToText

    release, name = request.param, RELEASES[request.param]
    source = resolve_debug_target("debug:" + name)
    with open(os.path.join(source, "config.json")) as f:
        text = {key: value for key, value in json.load(f).items() if key != "architectures"}
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(vision_language_config(release, text))
    state = model.state_dict()
    for key, tensor in AutoModelForCausalLM.from_pretrained(source).state_dict().items():
        state[key.replace("model.", "model.language_model.", 1)].copy_(tensor)
    directory = str(tmp_path_factory.mktemp(release) / "released")
    model.generation_config.eos_token_id = [258, 256]  # generation_config.json's EOS ids beside the config's one
    model.save_pretrained(directory)
    if release == "tiny-kimi-k2.5":  # the release ships its own code too (auto_map), which must never run
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        config["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                              "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f)
        for module in ("configuration_kimi_k25", "modeling_kimi_k25"):
            with open(os.path.join(directory, module + ".py"), "w") as f:
                f.write(f"open({os.path.join(directory, 'remote_code_ran')!r}, 'w').close()\n")
    native = load_file(os.path.join(source, "model.safetensors"))  # a native MTP module: top-level `mtp.*`, as shipped
    mtp = {key: tensor for key, tensor in native.items() if key.startswith("mtp.")}
    if mtp:
        path = os.path.join(directory, "model.safetensors")
        save_file({**load_file(path), **mtp}, path, metadata={"format": "pt"})
    for path in glob.glob(os.path.join(source, "tok*")) + glob.glob(os.path.join(source, "chat*")):
        shutil.copy(path, directory)
    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    text_prefix = "language_model.model." if release == "tiny-kimi-k2.5" else "model.language_model."
    assert text_prefix + "embed_tokens.weight" in keys and any("visual" in k or "vision" in k for k in keys)
    assert release != "tiny-kimi-k2.5" or not any(key.startswith("model.language_model.") for key in keys)
    return name, directory


def test_the_target_is_the_text_model_with_the_same_tokens(released):
    name, directory = released
    target, text = TargetModel.from_pretrained(directory), TargetModel.from_pretrained("debug:" + name)
    assert type(target.model) is type(text.model), type(target.model).__name__  # the towers are gone
    assert not any("vision" in key for key in target.model.state_dict())
    assert target.target_info().eos_token_ids == (258, 256)  # generation_config.json's, as the released models stop
    assert not os.path.exists(os.path.join(directory, "remote_code_ran"))  # transformers' classes, not the release's
    if name.startswith("tiny-gemma4") or name == "tiny-deepseek-v3":  # the text model keeps the checkpoint's class
        assert target.model.config.architectures[0].endswith("ForConditionalGeneration")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(target.model(ids).logits, text.model(ids).logits)
    # the same modules on the same weights: every round computes what the text target's does, bit for bit
    drafters = ["ngram"] + (["native-mtp"] if DEBUG_TARGETS[name]["mtp"] else [])
    for kind in drafters:
        runs = []
        for each in (target, text):
            drafter = (NgramDrafter(NgramDrafter.Config(), each.target_info()) if kind == "ngram"
                       else load_drafter(kind, each.target_info()))
            runs.append(speculative_generate(each, drafter, PROMPTS, num_draft_tokens=3, max_new_tokens=24,
                                             eos_token_ids=[]))
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths, kind


def test_the_head_and_the_meta_model_are_the_text_models(released):
    name, directory = released
    text = TargetModel.from_pretrained("debug:" + name).model
    head = head_target(directory, torch.float32, "cpu").model
    for get in ("get_input_embeddings", "get_output_embeddings"):
        assert torch.equal(getattr(head, get)().weight, getattr(text, get)().weight), get
    assert torch.equal(head.get_decoder().norm.weight, text.get_decoder().norm.weight)
    meta = TargetModel.from_config(directory).model
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in text.state_dict().items()}


def test_train_and_export_read_the_released_checkpoint(released, tmp_path):
    """One EAGLE-3 step on the released checkpoint, then its export in the speculators layout (which reads only the
    target's head out of the checkpoint's safetensors): the trained drafter reads the text model."""
    name, directory = released
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                      {"role": "assistant", "content": "1 2 3 4 5 " * 4}]}) + "\n"
                             for i in range(6)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = str(tmp_path / "run")
    assert cli(["train", os.path.join(root, "recipes", "debug", "tiny_eagle3.yaml"), f"target.name_or_path={directory}",
                f"output.dir={run}", f"data.path={chats}", "train.max_steps=1", "train.epochs=null",
                "data.num_samples=4", "data.num_eval_samples=2", "train.batch_size=2", "train.eval_every=null",
                "train.save_every=null", "train.phases=[]", "eval.num_prompts=1", "eval.max_new_tokens=4",
                "eval.num_batches=1"]) == 0
    with open(os.path.join(run, "final", "config.json")) as f:
        assert json.load(f)["target"]["num_layers"] == TargetModel.from_pretrained("debug:" + name).num_layers
    out = str(tmp_path / "speculators")
    assert cli(["export", os.path.join(run, "final"), "--format", "speculators", "--out", out,
                "--target", directory]) == 0
    assert os.path.exists(os.path.join(out, "config.json"))


def test_a_native_mtp_export_keeps_the_released_layout(released, tmp_path):
    """`export --format qwen3_5` of the imported module into a released Qwen3.5 checkpoint: every tensor of the source
    (vision tower included) written back bit for bit, the config still a vision-language one whose text config counts
    the MTP layer where vLLM reads it, and the written checkpoint serves that module losslessly."""
    name, directory = released
    if not DEBUG_TARGETS[name]["mtp"]:
        pytest.skip("no native MTP module in this family's checkpoint")
    from test_mtp_qwen35 import load

    from drafters.mtp import MTPDrafter
    from drafters.mtp.export import checkpoint_index, read_tensors

    drafter = MTPDrafter.from_target(TargetModel.from_pretrained(directory).target_info())
    out = str(tmp_path / "served")
    drafter.save(out, "qwen3_5")
    before, after = checkpoint_index(directory), checkpoint_index(out)
    assert set(after) == set(before)
    written, source = read_tensors(out, after, after), read_tensors(directory, before, before)
    assert all(torch.equal(written[key], tensor) for key, tensor in source.items())
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert "vision_config" in config and config["text_config"]["mtp_num_hidden_layers"] == 1
    served = load(out, torch.float64)  # float64 (greedy equality is exact there), experts in their per-expert loop
    plain = speculative_generate(served, None, PROMPTS, num_draft_tokens=0, max_new_tokens=16, eos_token_ids=[])
    spec = speculative_generate(served, load_drafter("native-mtp", served.target_info()).double(), PROMPTS,
                                num_draft_tokens=3, max_new_tokens=16, eos_token_ids=[])
    assert spec.tokens == plain.tokens
