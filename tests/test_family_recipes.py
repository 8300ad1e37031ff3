"""Every debug recipe trains on the study's families by target name alone (`draftsmith train recipes/debug/X.yaml
target.name_or_path=debug:NAME`): all recipes on a hybrid (Qwen3.5: gated DeltaNet + full attention), one recipe
on every family, and the study's own pairs (Gemma 4: assistant, DFlash, DSpark; Gemma 4 MoE: assistant, DFlash;
Qwen3.5-MoE: MTP, DFlash, DSpark);
one step each, with the in-training speculative probe through the engine. On a hybrid the served
layer ids are full-attention outputs (drafters/layer_ids.py), and a linear-attention id is refused in one line.
"""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoConfig

from drafters.layer_ids import attention_output_ids, auto_layer_ids, nearest_distinct
from drafters.ragged_state import config_dict
from inference.assets.debug_target import DEBUG_TARGET_VERSION, DEBUG_TARGETS
from train.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ["eagle3", "dflash", "dspark", "mtp", "medusa", "assistant"]
HYBRID = "tiny-qwen3.5"
# The study's own pairs beyond that: Gemma 4 with its assistant, DFlash and DSpark; Qwen3.6-35B-A3B's family
# (Qwen3.5-MoE) with native-style MTP, DFlash and DSpark; gemma-4-26B-A4B's (Gemma 4 with the MoE block and K = V
# global layers) with its assistant and DFlash.
STUDY_PAIRS = [(recipe, "tiny-gemma4") for recipe in ("assistant", "dflash", "dspark")] + [
    (recipe, "tiny-qwen3.5-moe") for recipe in ("mtp", "dflash", "dspark")] + [
    (recipe, "tiny-gemma4-moe") for recipe in ("assistant", "dflash")]
RUNS = [(recipe, HYBRID) for recipe in RECIPES] + [("eagle3", name) for name in DEBUG_TARGETS if name != HYBRID]
RUNS += STUDY_PAIRS
# The assistant's queries are plain multi-head attention; MLA's compressed cache is refused by name.
REFUSED = {("assistant", "tiny-deepseek-v3"): "cannot read the MLA cache of a deepseek_v3 target"}
SHORT = ["train.max_steps=1", "train.epochs=null", "data.num_samples=4", "data.num_eval_samples=2",
         "train.batch_size=2", "train.eval_every=null", "train.save_every=null", "train.phases=[]",
         "eval.num_batches=1", "eval.num_prompts=1", "eval.max_new_tokens=4"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    records = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about the number {i}."},
                                            {"role": "assistant", "content": f"The number {i} is a number. " * 6}]}
               for i in range(6)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def train(recipe: str, target: str, out: str, chats: str, *extra: str) -> int:
    return cli(["train", os.path.join(ROOT, "recipes", "debug", f"tiny_{recipe}.yaml"),
                f"target.name_or_path=debug:{target}", f"output.dir={out}", f"data.path={chats}", *SHORT, *extra])


@pytest.mark.parametrize("recipe,target", RUNS + list(REFUSED))
def test_debug_recipe_trains_on_the_family(recipe, target, chats, tmp_path, capsys):
    status = train(recipe, target, str(tmp_path / "run"), chats)
    if (recipe, target) in REFUSED:
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err and REFUSED[(recipe, target)] in err
        return
    assert status == 0, capsys.readouterr().err[-2000:]
    with open(tmp_path / "run" / "final" / "config.json") as f:
        header = json.load(f)
    assert header["target"]["name_or_path"].endswith(f"debug-{target}-{DEBUG_TARGET_VERSION}")
    # the config as TargetInfo carries it (Nemotron-H's layer kinds under another name, Jamba's derived from periods)
    target_config = config_dict(AutoConfig.from_pretrained(header["target"]["name_or_path"]))
    allowed = attention_output_ids(target_config, header["target"]["num_layers"])
    assert (allowed is None) == (target not in ("tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe",
                                                "tiny-nemotron-h", "tiny-granite-4", "tiny-jamba", "tiny-zamba2",
                                                "tiny-kimi-linear"))
    if allowed is not None:  # every id a hybrid's drafter reads is a full-attention layer's output
        assert set(header["target_layer_ids"]) <= set(allowed), header["target_layer_ids"]


@pytest.mark.parametrize("recipe,ids,message", [
    ("eagle3", "[1,4]", r"id 1 reads the output of layer 0 \(linear_attention\) of this hybrid target; a served "
                        r"drafter reads full-attention layers' outputs, ids \[2, 4\]"),
    ("dflash", "[3]", r"id 3 reads the output of layer 2 \(linear_attention\).*ids \[2\]"),
    ("dspark", "[0,2]", r"id 0 reads the embeddings of this hybrid target"),
])
def test_a_linear_attention_layer_id_is_refused_in_one_line(recipe, ids, message, chats, tmp_path, capsys):
    import re

    assert train(recipe, HYBRID, str(tmp_path / "run"), chats, f"drafter.layer_ids={ids}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(f"drafter.layer_ids: {message}", err), err[-600:]
    extra = [f"drafter.layer_ids={ids}", "drafter.allow_linear_attention_ids=true"]  # the opt-out trains
    assert train(recipe, HYBRID, str(tmp_path / "kept"), chats, *extra) == 0


def test_auto_moves_the_published_defaults_onto_full_attention_outputs():
    qwen35_27b = {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16}  # 64 layers
    assert attention_output_ids(qwen35_27b, 64) == list(range(4, 65, 4))
    assert auto_layer_ids((2, 32, 61), qwen35_27b, 64, "f") == (4, 32, 60)  # EAGLE-3's (2, N//2, N-3)
    assert auto_layer_ids((2, 17, 32, 47, 62), qwen35_27b, 63, "f") == (4, 16, 32, 48, 60)  # DFlash, ids < N
    assert auto_layer_ids((2, 18, 34), {"layer_types": ["full_attention"] * 36}, 36, "f") == (2, 18, 34)
    assert nearest_distinct([5, 5, 5], [4, 8]) == (4, 8)  # fewer candidates than targets: each used once
    with pytest.raises(ValueError, match="no full-attention layer"):
        auto_layer_ids((1,), {"layer_types": ["linear_attention", "full_attention"]}, 1, "f")


@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-gemma4-moe"])
def test_an_assistant_trained_on_gemma4_exports_for_transformers(name, chats, tmp_path):
    """The fresh assistant a Gemma 4 target gets is made of Gemma 4 layers: after training it exports as
    gemma4_assistant, transformers loads that with nothing missing, and reading it back gives the trained tensors
    (also over a target with the MoE block and K = V global layers of one KV head, as gemma-4-26B-A4B)."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    from drafters import load_drafter
    from inference.engine.target import TargetModel

    assert train("assistant", name, str(tmp_path / "run"), chats) == 0
    out = str(tmp_path / "hf")
    assert cli(["export", str(tmp_path / "run" / "final"), "--format", "gemma4_assistant", "--out", out,
                "--target", f"debug:{name}"]) == 0
    _, info = Gemma4AssistantForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    target = TargetModel.from_pretrained(f"debug:{name}").target_info()
    trained, back = load_drafter(str(tmp_path / "run" / "final"), target), load_drafter(out, target)
    for (key, ours), theirs in zip(trained.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours, theirs), key
