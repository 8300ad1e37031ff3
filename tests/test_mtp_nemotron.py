"""Nemotron-H's native MTP (Nemotron 3 Super's layout, as vLLM's NemotronHMTP reads it): one MTP step is several of
the family's one-mixer blocks (config `mtp_layers_block_type`, here an attention block and then an MoE block), numbered
`mtp.layers.0 .. P-1`, with enorm / hnorm / eh_proj on the first and `final_layernorm` on the last. On a tiny checkpoint
written here with the real transformers classes: the imported module's logits against the step written out from the
checkpoint's tensors, a bitwise import -> export round trip, lossless decoding through the engine, and the refusals.
A fresh MTP on a Nemotron-H target trains and decodes in tests/test_families_drafters.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, NemotronHConfig, NemotronHForCausalLM

from drafters import load_drafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.mtp.export import checkpoint_index, find_native, read_tensors
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider

LAYERS = ["linear_attention", "moe", "full_attention"]  # the target's blocks
STEP = ["full_attention", "moe"]  # one MTP step's blocks
N, HIDDEN, VOCAB = len(LAYERS), 32, 64


def config(layer_types, **extra) -> NemotronHConfig:
    return NemotronHConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                           n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, layer_types=layer_types,
                           moe_latent_size=12,  # Nemotron 3 Super's latent MoE: experts work in a narrower space
                           eos_token_id=None, bos_token_id=None, pad_token_id=None, **extra)


def rms(x, weight, eps=1e-5):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """(target directory, TargetModel, donor, MTP tensors): the step's blocks are layers N, N + 1 of a deeper model
    of the family ("donor"), saved by transformers in the checkpoint's own names and renamed as vLLM reads them."""
    directory = str(tmp_path_factory.mktemp("nemotron") / "target")
    torch.manual_seed(0)
    donor = NemotronHForCausalLM(config(LAYERS + STEP)).eval()
    donor.save_pretrained(directory + "_donor")
    stored = load_file(os.path.join(directory + "_donor", "model.safetensors"))
    base, mtp = {}, {}
    for name, tensor in stored.items():
        parts = name.split(".")
        if name.startswith("backbone.layers.") and int(parts[2]) >= N:
            mtp[".".join(["mtp.layers", str(int(parts[2]) - N), *parts[3:]])] = tensor
        else:
            base[name] = tensor
    gen = torch.Generator().manual_seed(1)
    for name in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.1.final_layernorm.weight"):
        mtp[name] = 1.0 + 0.2 * torch.randn(HIDDEN, generator=gen)
    mtp["mtp.layers.0.eh_proj.weight"] = 0.2 * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
    config(LAYERS, num_nextn_predict_layers=1, mtp_layers_block_type=STEP).save_pretrained(directory)
    save_file({**base, **mtp}, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    target = TargetModel(AutoModelForCausalLM.from_pretrained(directory), name_or_path=directory)
    return directory, target, donor, mtp


def reference_logits(donor, mtp, input_ids, hidden, lm_head, depth: int):
    """The step as vLLM's NemotronHMTP runs it, from the checkpoint's tensors: fuse, the attention block, the MoE
    block (each pre-norm with its residual), final_layernorm; depth 1 reads depth 0's normed output, tokens shifted
    one more. Logits [B, T - 1 - depth, V] at positions 0 .. T - 2 - depth."""
    length = input_ids.shape[1] - 1
    h = hidden[:, :length]
    for j in range(depth + 1):
        e = donor.model.embeddings(input_ids[:, 1 + j:])
        h = h[:, :e.shape[1]]
        x = torch.cat([rms(e, mtp["mtp.layers.0.enorm.weight"]), rms(h, mtp["mtp.layers.0.hnorm.weight"])], -1)
        x = x @ mtp["mtp.layers.0.eh_proj.weight"].T
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        mask = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))[None, None]
        for block in donor.model.layers[N:]:
            x = block(x, attention_mask=mask)
        h = rms(x, mtp["mtp.layers.1.final_layernorm.weight"])
    return h @ lm_head.T


def test_native_step_logits_equal_the_blocks_written_out(native):
    directory, target, donor, mtp = native
    drafter = load_drafter("native-mtp", target.target_info())
    assert drafter.kind == "mtp" and drafter.config.layout == "nemotron_h" and drafter.config.num_modules == 1
    assert [type(b).__name__ for b in drafter.layers[0].block] == ["NemotronHBlock"] * 2
    drafter.config.num_steps = 2
    drafter.config.proposer = "depths"  # depth 1 as written out below (vLLM's own steps: tests/test_mtp.py)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    ones = torch.ones_like(input_ids)
    batch = {"input_ids": input_ids, "attention_mask": ones, "loss_mask": ones}
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    with torch.no_grad():
        output = drafter(batch)
        for depth in range(2):
            expected = reference_logits(donor, mtp, input_ids, batch["final_hidden"], target.model.lm_head.weight,
                                        depth)
            valid = output.depth_valid[:, depth]
            rows, positions = output.batch_index[valid], output.label_position[valid, depth] - 2 - depth
            torch.testing.assert_close(output.logits[valid, depth], expected[rows, positions], rtol=1e-5, atol=1e-5)


def test_import_export_round_trip_is_bitwise(native, tmp_path):
    directory, target, _, mtp = native
    drafter = MTPDrafter.from_target(target.target_info())
    drafter.save(str(tmp_path / "out"), "nemotron_h")
    source_index, out_index = checkpoint_index(directory), checkpoint_index(str(tmp_path / "out"))
    assert set(out_index) == set(source_index) and "mtp.layers.1.mixer.fc1_latent_proj.weight" in source_index
    written = read_tensors(str(tmp_path / "out"), out_index, out_index)
    for name, tensor in read_tensors(directory, source_index, source_index).items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    with open(tmp_path / "out" / "config.json") as f:
        saved = json.load(f)
    assert saved["num_nextn_predict_layers"] == 1 and saved["mtp_layers_block_type"] == STEP
    assert find_native(str(tmp_path / "out"), N, "nemotron_h").layout == "nemotron_h"


def test_native_and_fine_tuned_steps_decode_losslessly(native, tmp_path):
    """The imported step proposes through the engine; a perturbed fine-tune exports into the target's checkpoint,
    reads back equal, and decodes losslessly as well."""
    directory, target, _, _ = native
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=12)
    drafter = load_drafter("native-mtp", target.target_info())
    assert speculative_generate(target, drafter, prompts, num_draft_tokens=3, max_new_tokens=12).tokens == plain.tokens
    tuned = MTPDrafter(MTPConfig(layout="nemotron_h", init_from_native=True, reuse=True, num_steps=2),
                       target.target_info())
    tuned.init_from_data(torch.zeros(VOCAB))
    with torch.no_grad():
        for parameter in tuned.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    tuned.save(str(tmp_path / "tuned"), "nemotron_h")
    back_target = TargetModel(AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned")),
                              name_or_path=str(tmp_path / "tuned"))
    back = load_drafter("native-mtp", back_target.target_info())
    for (name, ours), theirs in zip(tuned.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours, theirs), name
    spec = speculative_generate(back_target, back, prompts, num_draft_tokens=3, max_new_tokens=12)
    assert spec.tokens == plain.tokens


def test_layouts_that_cannot_carry_the_step_are_refused(native, tmp_path):
    _, target, _, _ = native
    drafter = MTPDrafter(MTPConfig(layout="speculators"), target.target_info())
    with pytest.raises(ValueError, match="carries one decoder layer per MTP module; this target's MTP step is 2 "
                                         r"blocks \(full_attention, moe\).*--format nemotron_h"):
        drafter.save(str(tmp_path / "spec"), "speculators")
    info = target.target_info()
    mamba_step = dataclasses.replace(info, config={**info.config, "mtp_layers_block_type": ["linear_attention"]})
    with pytest.raises(ValueError, match="mtp_layers_block_type .*one attention block"):
        MTPDrafter(MTPConfig(layout="nemotron_h"), mamba_step)


def test_a_step_trained_by_the_cli_exports_into_the_target_and_decodes(tmp_path, capsys):
    """`draftsmith train` (fresh step, layout nemotron_h) -> `draftsmith export --format nemotron_h` -> the exported
    target directory's own MTP (`native-mtp`) decodes losslessly."""
    from test_family_recipes import SHORT

    from inference.assets.debug_target import resolve_debug_target
    from train.cli import main as cli

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                      {"role": "assistant", "content": "one two three " * 8}]}) + "\n"
                             for i in range(4)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert cli(["train", os.path.join(root, "recipes", "debug", "tiny_mtp.yaml"), "target.name_or_path=debug:"
                "tiny-nemotron-h", f"output.dir={tmp_path / 'run'}", f"data.path={chats}", *SHORT,
                "drafter.layout=nemotron_h", "drafter.num_modules=1", "drafter.reuse=true"]) == 0
    served = str(tmp_path / "served")
    assert cli(["export", str(tmp_path / "run" / "final"), "--format", "nemotron_h", "--out", served]) == 0
    source = resolve_debug_target("debug:tiny-nemotron-h")
    assert set(checkpoint_index(served)) - set(checkpoint_index(source)) == {
        "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.norm.weight", *(f"mtp.layers.0.mixer.{p}_proj.weight" for p in "qkvo"),
        "mtp.layers.1.norm.weight", "mtp.layers.1.final_layernorm.weight", "mtp.layers.1.mixer.gate.weight",
        "mtp.layers.1.mixer.gate.e_score_correction_bias", "mtp.layers.1.mixer.shared_experts.up_proj.weight",
        "mtp.layers.1.mixer.shared_experts.down_proj.weight",
        *(f"mtp.layers.1.mixer.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("up", "down"))}
    target = TargetModel(AutoModelForCausalLM.from_pretrained(served), name_or_path=served)
    drafter = load_drafter("native-mtp", target.target_info())
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=10)
    assert speculative_generate(target, drafter, prompts, num_draft_tokens=2, max_new_tokens=10).tokens == plain.tokens
