"""The recipes for the AMD/vLLM study's models (amd_vllm_study.md) parse through the strict loader and build, on the
meta device, drafters with the settings the study's checkpoints used: layer ids (ours = z-lab's + 1), block sizes,
draft steps and the k of the study's example commands; thinking off where the template has the option.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_config import GEMMA4_26B_A4B, GEMMA4_31B, QWEN36_27B, QWEN36_35B_A3B, meta_target_info

from drafters import DRAFTERS
from drafters.layer_ids import attention_output_ids
from train.config import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZLAB_QWEN36_27B = [1, 10, 18, 27, 35, 44, 52, 61]  # z-lab's dflash_config.target_layer_ids (layer outputs)
ZLAB_GEMMA4_31B = [1, 12, 23, 35, 46, 57]
ZLAB_GEMMA4_26B_A4B = [1, 6, 11, 17, 22, 27]
ZLAB_QWEN36_35B_A3B = [1, 10, 19, 28, 37]
# recipe -> (target shape, drafter fields the study's checkpoint fixes, eval k of the study's example command)
STUDY = {
    "qwen3.6-27b/mtp.yaml": (QWEN36_27B, dict(layout="qwen3_5", init_from_native=True, reuse=True, num_steps=5), 3),
    "qwen3.6-27b/dflash.yaml": (QWEN36_27B, dict(block_size=16, num_layers=6, mask_token_id=248077), 15),
    "gemma-4-31b/assistant.yaml": (GEMMA4_31B, dict(num_layers=4, num_steps=4), 4),
    "gemma-4-31b/eagle3.yaml": (GEMMA4_31B, dict(ttt_steps=5), 3),
    "gemma-4-31b/dflash.yaml": (GEMMA4_31B, dict(block_size=16, num_layers=5, mask_token_id=4), 15),
    "gemma-4-31b/dspark.yaml": (GEMMA4_31B, dict(block_size=7, mask_token_id=4), 7),
    "gemma-4-26b-a4b/assistant.yaml": (GEMMA4_26B_A4B, dict(num_layers=4, num_steps=5), 5),
    "gemma-4-26b-a4b/eagle3.yaml": (GEMMA4_26B_A4B, dict(ttt_steps=5), 1),
    "gemma-4-26b-a4b/dflash.yaml": (GEMMA4_26B_A4B, dict(block_size=16, num_layers=5, mask_token_id=4), 15),
    "qwen3.6-35b-a3b/mtp.yaml": (QWEN36_35B_A3B, dict(layout="qwen3_5", init_from_native=True, reuse=True,
                                                      num_steps=6), 3),
    "qwen3.6-35b-a3b/dflash.yaml": (QWEN36_35B_A3B, dict(block_size=16, num_layers=8, mask_token_id=248070), 15),
}


def build(name):
    recipe = load_recipe(os.path.join(ROOT, "recipes", name))
    shape, fields, k = STUDY[name]
    info = meta_target_info(shape)
    with torch.device("meta"):
        drafter = DRAFTERS[recipe.drafter_kind](recipe.drafter, info)
    return recipe, drafter, fields, k


@pytest.mark.parametrize("name", list(STUDY))
def test_study_recipe_has_the_studys_settings(name):
    recipe, drafter, fields, k = build(name)
    for field, value in fields.items():
        assert getattr(recipe.drafter, field) == value, field
    assert recipe.eval.num_draft_tokens == k
    limit = drafter.max_draft_tokens()
    assert limit is None or k <= limit  # the example command's N fits the drafter
    if name.startswith("qwen3.6"):
        assert recipe.data.chat_template_kwargs == {"enable_thinking": False}


def test_layer_ids_are_the_published_checkpoints():
    _, qwen, _, _ = build("qwen3.6-27b/dflash.yaml")
    assert list(qwen.layer_ids) == [t + 1 for t in ZLAB_QWEN36_27B]
    allowed = attention_output_ids(QWEN36_27B.to_dict(), 63)
    assert not set(qwen.layer_ids) <= set(allowed)  # z-lab reads gated-DeltaNet layers: kept only by the opt-out
    for name in ("gemma-4-31b/dflash.yaml", "gemma-4-31b/dspark.yaml"):
        assert list(build(name)[1].layer_ids) == [t + 1 for t in ZLAB_GEMMA4_31B], name
    assert build("gemma-4-31b/eagle3.yaml")[1].layer_ids == (2, 30, 57)  # auto = vLLM's (2, N//2, N-3)
    assert list(build("gemma-4-26b-a4b/dflash.yaml")[1].layer_ids) == [t + 1 for t in ZLAB_GEMMA4_26B_A4B]
    assert build("gemma-4-26b-a4b/eagle3.yaml")[1].layer_ids == (2, 15, 27)
    moe = build("qwen3.6-35b-a3b/dflash.yaml")[1]
    assert list(moe.layer_ids) == [t + 1 for t in ZLAB_QWEN36_35B_A3B]
    # four read gated-DeltaNet layers (kept by the opt-out), one a full-attention layer (layer 19)
    assert set(moe.layer_ids) - set(attention_output_ids(QWEN36_35B_A3B.to_dict(), 40)) == {2, 11, 29, 38}


@pytest.mark.parametrize("name,kv_layers,global_layer", [
    # the global layers cache 4 (31B) / 2 (26B-A4B) KV heads (attention_k_eq_v with num_global_key_value_heads):
    # so do the assistant's global queries
    ("gemma-4-31b/assistant.yaml", (58, 58, 58, 59), {"head_dim": 512, "num_key_value_heads": 4}),
    ("gemma-4-26b-a4b/assistant.yaml", (28, 28, 28, 29), {"head_dim": 512, "num_key_value_heads": 2})])
def test_the_gemma4_assistant_is_built_from_gemma4_layers(name, kv_layers, global_layer):
    _, assistant, _, _ = build(name)
    types = assistant.config.gemma4_config["layer_types"]
    assert types == ["sliding_attention"] * 3 + ["full_attention"]
    assert assistant.kv_layers == kv_layers  # the target's last sliding and last global layer
    assert assistant.config.gemma4_config["per_layer_config"] == {"3": global_layer}
