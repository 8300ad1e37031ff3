"""Native MTP in the Qwen3.5 / 3.6 layout (drafters/mtp/export.py "qwen3_5") on the debug targets that ship one
(debug:tiny-qwen3.5, dense, and debug:tiny-qwen3.5-moe: gated-DeltaNet hybrids whose MTP module is a full-attention
layer of the family under mtp.*, counted by mtp_num_hidden_layers): the module computes what transformers' own layer
computes, import -> export is bitwise, a fine-tune exports into the target and reads back, decoding through the
engine stays greedy-exact at batch 1 and 3, fused experts keep their form, and two modules are refused.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafters import load_drafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.mtp.export import checkpoint_index, find_native, fuse_experts, read_tensors
from inference.assets.debug_target import build_tokenizer, debug_config, resolve_debug_target
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider

NAMES = ["tiny-qwen3.5", "tiny-qwen3.5-moe"]


def load(name_or_dir: str, dtype=torch.float32) -> TargetModel:
    """float64 for exactness tests, with transformers' per-expert loop (its grouped matmul takes no float64)."""
    directory = name_or_dir if os.path.isdir(name_or_dir) else resolve_debug_target(f"debug:{name_or_dir}")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, experts_implementation="eager").eval()
    return TargetModel(model, AutoTokenizer.from_pretrained(directory), name_or_path=directory)


def zero_centred_rms(x, weight, eps):
    return (1 + weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(name: str, target: TargetModel, input_ids: torch.Tensor, depth: int, scratch) -> torch.Tensor:
    """The checkpoint's module as vLLM's Qwen3.5 MTP runs it, written out here: fc([norm_e(embed) ; norm_h(h)]) ->
    transformers' own decoder layer N of the family (a model one layer deeper, loaded with the module's weights)
    -> norm -> the target's lm_head; depth 1 reads the normed output. Logits [B, T - 1 - depth, V]."""
    directory = target.name_or_path
    stored = load_file(os.path.join(directory, "model.safetensors"))
    num_layers = target.target_info().num_layers
    config = debug_config(name, build_tokenizer(), num_layers + 1)
    layer = {f"model.layers.{num_layers}." + k.removeprefix("mtp.layers.0."): t
             for k, t in stored.items() if k.startswith("mtp.layers.0.")}
    config.save_pretrained(str(scratch))  # transformers itself reads the checkpoint's names (experts one by one)
    save_file({**{k: t for k, t in stored.items() if not k.startswith("mtp.")}, **layer},
              os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})
    deeper = AutoModelForCausalLM.from_pretrained(str(scratch), attn_implementation="sdpa").eval()
    eps = config.rms_norm_eps
    with torch.no_grad():
        out = target.model(input_ids=input_ids, output_hidden_states=True)
        h = out.hidden_states[-1]  # the target's final hidden state, after its norm
        block, rotary = deeper.model.layers[num_layers], deeper.model.rotary_emb
        for j in range(depth + 1):
            e = deeper.model.embed_tokens(input_ids[:, 1 + j:])
            h = h[:, :e.shape[1]]
            positions = torch.arange(e.shape[1])[None].expand(e.shape[0], -1)
            x = torch.cat([zero_centred_rms(e, stored["mtp.pre_fc_norm_embedding.weight"], eps),
                           zero_centred_rms(h, stored["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
            x = x @ stored["mtp.fc.weight"].T
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
            sections = positions.expand(3, *positions.shape)  # text, height, width: transformers 5.17 wants all 3
            y = block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, sections))
            y = y[0] if isinstance(y, tuple) else y
            h = zero_centred_rms(y, stored["mtp.norm.weight"], eps)
        return h @ target.model.lm_head.weight.T


@pytest.mark.parametrize("name", NAMES)
def test_native_module_equals_the_familys_own_layer(name, tmp_path):
    target = load(name)
    info = target.target_info()
    found = find_native(target.name_or_path, info.num_layers, info.config["model_type"])
    assert (found.layout, found.num_modules) == ("qwen3_5", 1)
    drafter = load_drafter("native-mtp", info)
    assert drafter.config.layout == "qwen3_5" and drafter.max_draft_tokens() is None  # reused, as vLLM does
    drafter.config.num_steps = 2
    drafter.config.proposer = "depths"  # the reference's depth 1 (the served steps: tests/test_mtp.py test_server_*)
    input_ids = torch.randint(0, 250, (2, 14), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "loss_mask": torch.ones_like(input_ids)}
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    with torch.no_grad():
        output = drafter(batch)
    for depth in range(2):
        expected = reference_logits(name, target, input_ids, depth, tmp_path / f"deeper{depth}")
        valid = output.depth_valid[:, depth]
        rows, positions = output.batch_index[valid], output.label_position[valid, depth] - 2 - depth
        torch.testing.assert_close(output.logits[valid, depth], expected[rows, positions], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_import_export_is_bitwise_and_a_fine_tune_reads_back_losslessly(name, tmp_path):
    target = load(name)
    source = target.name_or_path
    drafter = MTPDrafter.from_target(target.target_info())
    drafter.save(str(tmp_path / "same"), "qwen3_5")
    before, after = checkpoint_index(source), checkpoint_index(str(tmp_path / "same"))
    assert set(after) == set(before)
    original, written = read_tensors(source, before, before), read_tensors(str(tmp_path / "same"), after, after)
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    with open(tmp_path / "same" / "config.json") as f:
        config = json.load(f)
    assert config["mtp_num_hidden_layers"] == 1 and "num_nextn_predict_layers" not in config

    tuned = MTPDrafter(MTPConfig(layout="qwen3_5", init_from_native=True, reuse=True, num_steps=2),
                       target.target_info())
    tuned.init_from_data(torch.zeros(8))  # what training calls before its first step
    with torch.no_grad():
        for parameter in tuned.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    tuned.save(str(tmp_path / "tuned"), "qwen3_5")
    served = load(str(tmp_path / "tuned"), torch.float64)
    back = load_drafter("native-mtp", served.target_info())
    for (key, ours), theirs in zip(tuned.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours.double(), theirs), key
    for key, tensor in load(source, torch.float64).model.state_dict().items():
        assert torch.equal(served.model.state_dict()[key], tensor), key  # the target itself is untouched
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 101, 102, 103, 104]]
    for batch in (prompts[:1], prompts):
        plain = speculative_generate(served, None, batch, num_draft_tokens=0, max_new_tokens=24)
        spec = speculative_generate(served, back, batch, num_draft_tokens=3, max_new_tokens=24)
        assert spec.tokens == plain.tokens
    with pytest.raises(ValueError, match="ships its MTP weights in the qwen3_5 layout"):
        tuned.save(str(tmp_path / "wrong"), "qwen3_next")


def test_fused_experts_keep_their_form_and_two_modules_are_refused(tmp_path):
    target = load("tiny-qwen3.5-moe")
    info = target.target_info()
    # The layout has one fc and one set of norms for all its layers: two modules of ours do not fit it.
    with pytest.raises(ValueError, match="--format qwen3_5 carries exactly one MTP module"):
        MTPDrafter(MTPConfig(num_modules=2, layout="qwen3_5"), info).save(str(tmp_path / "two"), "qwen3_5")
    assert not os.path.exists(tmp_path / "two")
    # A source storing its experts fused (experts.gate_up_proj [E, 2I, D]) is written back fused, bitwise.
    fused_dir = tmp_path / "fused"
    shutil.copytree(target.name_or_path, fused_dir)
    stored = load_file(str(fused_dir / "model.safetensors"))
    block = {k.removeprefix("mtp.layers.0."): t for k, t in stored.items() if k.startswith("mtp.layers.0.")}
    rest = {k: t for k, t in stored.items() if not k.startswith("mtp.layers.0.")}
    fused = {"mtp.layers.0." + k: t.contiguous() for k, t in fuse_experts(block).items()}
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in fused
    save_file({**rest, **fused}, str(fused_dir / "model.safetensors"), metadata={"format": "pt"})
    drafter = MTPDrafter.from_target(load(str(fused_dir)).target_info())
    drafter.save(str(tmp_path / "fused_out"), "qwen3_5")
    written = load_file(str(tmp_path / "fused_out" / "model-mtp.safetensors"))
    assert set(written) == {k for k in {**rest, **fused} if k.startswith("mtp.")}
    for key in written:
        assert torch.equal(written[key], fused[key] if key in fused else rest[key]), key
