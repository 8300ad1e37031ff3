"""Recipe schema and loader: strict keys with dotted names, overrides, round trips, derived values, the schedule,
and every recipe in recipes/ loading and building its drafter (on the meta device for the real targets)."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import yaml
from transformers import (DeepseekV3Config, Gemma4TextConfig, LlamaConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3Config, Qwen3NextConfig)
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

from benchmarks.training.config_only_target import (GEMMA4_26B_A4B_TEXT, GEMMA4_31B_TEXT, KIMI_K25_TEXT,
                                                    MINIMAX_M3_TEXT, QWEN36_27B_TEXT)
from drafters import DRAFTERS, TargetInfo
from train.config import ScheduleConfig, derive, load_recipe, parse_overrides, recipe_from_dict, recipe_to_dict, \
    save_recipe
from train.fit.optim import lr_factor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_RECIPE = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")

# The published shapes of the targets the recipes name (no weights needed: the drafter is built on the meta device).
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True)
LLAMA31_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         rope_theta=500000.0)
QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0)
QWEN3_NEXT = Qwen3NextConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
# The study's targets (amd_vllm_study.md): Qwen3.6-27B's text model (48 gated-DeltaNet + 16 full-attention layers) and
# gemma-4-31B (60 layers, 5 sliding : 1 global); heads and widths as assumed here, the recipes depend on the layer
# types, the layer count, the width and the vocabulary.
# The same fields benchmarks/training/config_only_target.py writes for `estimate --config-only`:
QWEN36_27B = Qwen3_5TextConfig(**QWEN36_27B_TEXT)
# gemma-4-31B: its global layers have 4 KV heads of 512 whose values are their keys; gemma-4-26B-A4B (25.2B
# parameters, 3.8B active): a dense MLP beside 128 experts (top 8) per layer, global layers of 2 such KV heads
GEMMA4_31B, GEMMA4_26B_A4B = (Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
                              for text in (GEMMA4_31B_TEXT, GEMMA4_26B_A4B_TEXT))
# Qwen3.6-35B-A3B's text config: transformers' Qwen3_5MoeTextConfig defaults are that model's (40 layers of 2048,
# every fourth full attention, 256 experts top 8 and a shared one), with its one MTP module
QWEN36_35B_A3B = Qwen3_5MoeTextConfig(mtp_num_hidden_layers=1)
DEEPSEEK_V3 = DeepseekV3Config(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, max_position_embeddings=163840)
# Kimi-K2.5's text model: DeepSeek-V3's with 384 experts, 64 heads and its own vocabulary
KIMI_K25 = DeepseekV3Config(**{key: value for key, value in KIMI_K25_TEXT.items() if key != "model_type"})
# MiniMax-M3's: transformers' defaults with three dense full-attention layers before 57 sparse MoE ones
MINIMAX_M3 = MiniMaxM3VLTextConfig(**MINIMAX_M3_TEXT)
TARGET_SHAPES = {"smollm2": SMOLLM2, "llama3.1-8b": LLAMA31_8B, "qwen3-8b": QWEN3_8B, "qwen3-next": QWEN3_NEXT,
                 "qwen3.6-27b": QWEN36_27B, "gemma-4-31b": GEMMA4_31B, "gemma-4-26b-a4b": GEMMA4_26B_A4B,
                 "qwen3.6-35b-a3b": QWEN36_35B_A3B,
                 "deepseek-v3": DEEPSEEK_V3, "kimi-k2.5": KIMI_K25, "minimax-m3": MINIMAX_M3}


def meta_target_info(config) -> TargetInfo:
    with torch.device("meta"):
        embed = torch.empty(config.vocab_size, config.hidden_size)
        norm = torch.empty(config.hidden_size)
    return TargetInfo(name_or_path="meta", hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                      num_layers=config.num_hidden_layers, embed_weight=embed, lm_head_weight=embed,
                      final_norm_weight=norm, rms_norm_eps=config.rms_norm_eps, eos_token_ids=(2,), pad_token_id=None,
                      config=config.to_dict())


def recipe_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True))
    return [f for f in files if os.sep + "accelerate" + os.sep not in f]


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "recipes")))
def test_every_recipe_loads_round_trips_and_builds(path, tmp_path):
    recipe = load_recipe(path)
    saved = tmp_path / "recipe.yaml"
    save_recipe(recipe, str(saved))
    assert recipe_to_dict(load_recipe(str(saved))) == recipe_to_dict(recipe)
    family = os.path.basename(os.path.dirname(path))
    if family == "debug":
        from inference.assets.debug_target import write_debug_target
        from inference.engine.target import TargetModel

        write_debug_target("tiny-llama", str(tmp_path / "target"))
        info = TargetModel.from_pretrained(str(tmp_path / "target")).target_info()
        drafter = DRAFTERS[recipe.drafter_kind](recipe.drafter, info)
    else:
        info = meta_target_info(TARGET_SHAPES[family])
        with torch.device("meta"):
            drafter = DRAFTERS[recipe.drafter_kind](recipe.drafter, info)
    assert all(0 <= i <= info.num_layers for i in drafter.target_layer_ids())
    assert len(list(drafter.parameters())) > 0


def test_accelerate_configs_are_yaml_with_a_distributed_type():
    files = sorted(glob.glob(os.path.join(ROOT, "recipes", "accelerate", "*.yaml")))
    assert {os.path.basename(f) for f in files} >= {"1gpu.yaml", "8gpu_ddp.yaml", "8gpu_fsdp.yaml", "cpu_ddp2.yaml"}
    for path in files:
        with open(path) as f:
            config = yaml.safe_load(f)
        assert "distributed_type" in config and "num_processes" in config


def test_an_empty_mapping_on_the_command_line_empties_the_recipes_and_one_with_entries_merges():
    """Before, `data.chat_template_kwargs={}` merged nothing into the recipe's mapping: no override could empty it."""
    recipe = os.path.join(ROOT, "recipes", "qwen3.6-27b", "mtp.yaml")  # its data.chat_template_kwargs: thinking off
    assert load_recipe(recipe, ["data.chat_template_kwargs={}"]).data.chat_template_kwargs == {}
    merged = load_recipe(recipe, ["data.chat_template_kwargs={reasoning_effort: low}"]).data.chat_template_kwargs
    assert merged == {"enable_thinking": False, "reasoning_effort": "low"}
    assert load_recipe(DEBUG_RECIPE, ["train={max_steps: 3}"]).train.epochs == load_recipe(DEBUG_RECIPE).train.epochs


def test_unknown_keys_name_the_dotted_key():
    with pytest.raises(ValueError, match=r"optim\.lrr"):
        load_recipe(DEBUG_RECIPE, ["optim.lrr=1e-3"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) colour"):
        load_recipe(DEBUG_RECIPE, ["colour=red"])
    with pytest.raises(ValueError, match=r"drafter\.ttt_step\b"):
        load_recipe(DEBUG_RECIPE, ["drafter.ttt_step=2"])
    with pytest.raises(ValueError, match=r"data\.max_len\b"):
        load_recipe(DEBUG_RECIPE, ["data.max_len=10"])
    with pytest.raises(ValueError, match=r"train\.phases\[0\]\.drafter\.nope"):
        load_recipe(DEBUG_RECIPE, ["train.phases=[{until_fraction: 0.5, drafter: {nope: 1}}]"])
    with pytest.raises(ValueError, match=r"drafter\.kind: 'eagle9'"):
        load_recipe(DEBUG_RECIPE, ["drafter.kind=eagle9"])


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"optim\.lr: expected float"):
        load_recipe(DEBUG_RECIPE, ["optim.lr=fast"])
    with pytest.raises(ValueError, match=r"features\.mode"):
        load_recipe(DEBUG_RECIPE, ["features.mode=sometimes"])
    with pytest.raises(ValueError, match=r"train\.phases\[1\]\.until_fraction"):
        load_recipe(DEBUG_RECIPE, ["train.phases=[{until_fraction: 0.5}, {until_fraction: 0.4}]"])
    with pytest.raises(ValueError, match="not of the form"):
        load_recipe(DEBUG_RECIPE, ["optim.lr"])


def test_overrides_parse_as_yaml_and_merge():
    assert parse_overrides(["a.b=1", "a.c=[1, 2]", "d=null", "e=3.0e-4", "f=text", "g=3e-4"]) == {
        "a": {"b": 1, "c": [1, 2]}, "d": None, "e": 3e-4, "f": "text", "g": "3e-4"}  # YAML 1.1 reads 3e-4 as text
    recipe = load_recipe(DEBUG_RECIPE, ["optim.lr=3e-4", "drafter.ttt_steps=5", "output.dir=/tmp/x",
                                        "train.phases=[]", "optim.betas=[0.8, 0.9]"])
    assert recipe.optim.lr == 3e-4 and recipe.drafter.ttt_steps == 5 and recipe.output.dir == "/tmp/x"
    assert recipe.train.phases == [] and recipe.optim.betas == (0.8, 0.9)
    assert recipe.data.max_length == load_recipe(DEBUG_RECIPE).data.max_length  # untouched keys survive


def test_phase_overrides_are_coerced_to_the_drafter_field_types():
    recipe = load_recipe(DEBUG_RECIPE, ["train.phases=[{until_fraction: 0.25, drafter: {ttt_steps: '2'}}]"])
    assert recipe.train.phases[0].drafter == {"ttt_steps": 2}


def test_derive_accumulation_and_steps():
    base = recipe_to_dict(load_recipe(DEBUG_RECIPE))
    base["train"].update(batch_size=2, grad_accum=None, global_batch_size=8, max_steps=None, epochs=1.5)
    derived = derive(recipe_from_dict(base), world_size=2, num_train_samples=100)
    assert (derived.grad_accum, derived.global_batch_size, derived.steps_per_epoch, derived.max_steps) == (2, 8, 12, 18)
    base["train"]["global_batch_size"] = 6
    with pytest.raises(ValueError, match="not a multiple"):
        derive(recipe_from_dict(base), world_size=2, num_train_samples=100)
    base["train"].update(global_batch_size=None, epochs=None)
    with pytest.raises(ValueError, match="max_steps or train.epochs"):
        derive(recipe_from_dict(base), world_size=1, num_train_samples=100)
    base["train"].update(max_steps=5, batch_size=64)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        derive(recipe_from_dict(base), world_size=2, num_train_samples=100)


def test_learning_rate_schedule_shapes():
    cosine = ScheduleConfig(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(step, max_steps=14, config=cosine) for step in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert factors[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(factors[4:], factors[5:]))
    linear = ScheduleConfig(kind="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_factor(s, max_steps=5, config=linear) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    assert lr_factor(100, max_steps=5, config=ScheduleConfig(kind="constant")) == 1.0


@pytest.mark.parametrize("argv,message", [
    (["train", "recipes/debug/tiny_eagle3.yaml", "drafter.nope=1"], "drafter.nope"),
    (["prepare", "missing.yaml"], "missing.yaml"),
    (["estimate", "recipes/debug/tiny_eagle3.yaml", "optim.lr=fast"], "optim.lr"),
    (["export", "tests", "--format", "speculators", "--out", "unused"], "no config.json"),
])
def test_commands_report_bad_input_in_one_line(argv, message, capsys):
    from train.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err
