"""MTP heads (drafters/mtp/): the training forward against a naive per-cell reference, the loss, the native layouts
(DeepSeek-V3, Qwen3-Next, MiMo) on tiny checkpoints written here with the real transformers classes, their bitwise
import -> export round trips, the speculators layout, and bad input. The proposer's agreement with the training
forward, lossless decoding and save/load are tested for every drafter in test_contract.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from drafters import load_drafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.mtp.export import checkpoint_index, find_native, read_tensors
from drafters.mtp.layers import causal_mask
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider

NUM_LAYERS = 2  # of every tiny native target; its MTP module is layer index 2 where the layout numbers it so
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, max_position_embeddings=128,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)


def family_config(layout: str, num_layers: int):
    """A tiny config of the family that ships MTP weights in `layout` (MiMo's backbone is Qwen2)."""
    if layout == "deepseek_v3":  # MLA attention, and the MTP layer (index >= first_k_dense_replace) is MoE
        return DeepseekV3Config(**TINY, num_hidden_layers=num_layers, num_key_value_heads=4, moe_intermediate_size=16,
                                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                                qk_nope_head_dim=4, v_head_dim=8)
    if layout == "qwen3_next":  # gated full attention with zero-centred q/k norms, partial RoPE, MoE + shared expert
        return Qwen3NextConfig(**TINY, num_hidden_layers=num_layers, num_key_value_heads=2, head_dim=8,
                               moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                               num_experts_per_tok=2, linear_num_value_heads=2, linear_num_key_heads=2,
                               linear_key_head_dim=8, linear_value_head_dim=8,
                               layer_types=(["linear_attention", "full_attention"] * num_layers)[:num_layers])
    return Qwen2Config(**TINY, num_hidden_layers=num_layers, num_key_value_heads=2)


FAMILY_CLASSES = {"deepseek_v3": DeepseekV3ForCausalLM, "qwen3_next": Qwen3NextForCausalLM, "mimo": Qwen2ForCausalLM}
# The layouts' names, written out here independently of drafters/mtp/export.py: (fixed-name prefix, block prefix,
# {role: name}).
P = f"model.layers.{NUM_LAYERS}."
NAMES = {
    "deepseek_v3": (P, P, dict(enorm="enorm.weight", hnorm="hnorm.weight", proj="eh_proj.weight",
                               final="shared_head.norm.weight")),
    "qwen3_next": ("mtp.", "mtp.layers.0.", dict(enorm="pre_fc_norm_embedding.weight", final="norm.weight",
                                                 hnorm="pre_fc_norm_hidden.weight", proj="fc.weight")),
    "mimo": ("model.mtp_layers.0.",) * 2 + (dict(enorm="token_layernorm.weight", hnorm="hidden_layernorm.weight",
                                                 proj="input_proj.weight", final="final_layernorm.weight"),),
}
LAYOUTS = list(NAMES)


def write_native_target(directory: str, layout: str):
    """A tiny target checkpoint with one MTP module in `layout`. The module's decoder block is layer NUM_LAYERS of a
    one-layer-deeper model of the same family ("donor"), saved by transformers in the checkpoint's own names.
    Returns (the donor model, {name: tensor} of the MTP tensors written)."""
    torch.manual_seed(0)
    donor_config = family_config(layout, NUM_LAYERS + 1)
    if layout == "qwen3_next":
        donor_config.layer_types = ["linear_attention", "full_attention", "full_attention"]
    donor = FAMILY_CLASSES[layout](donor_config).eval()
    donor.save_pretrained(directory + "_donor")
    stored = load_file(os.path.join(directory + "_donor", "model.safetensors"))
    layer = f"model.layers.{NUM_LAYERS}."
    base = {name: t for name, t in stored.items() if not name.startswith(layer)}
    fixed_prefix, block_prefix, roles = NAMES[layout]
    mtp = {block_prefix + name.removeprefix(layer): t for name, t in stored.items() if name.startswith(layer)}
    gen = torch.Generator().manual_seed(1)
    centre = 0.0 if layout == "qwen3_next" else 1.0  # Qwen3-Next norms scale by 1 + w
    for role in ("enorm", "hnorm", "final"):
        mtp[fixed_prefix + roles[role]] = centre + 0.2 * torch.randn(32, generator=gen)
    mtp[fixed_prefix + roles["proj"]] = 0.2 * torch.randn(32, 64, generator=gen)
    if layout == "deepseek_v3":  # DeepSeek-V3 stores the shared embedding and head again per module
        mtp[P + "embed_tokens.weight"] = base["model.embed_tokens.weight"].clone()
        mtp[P + "shared_head.head.weight"] = base["lm_head.weight"].clone()
    config = family_config(layout, NUM_LAYERS)
    config.num_nextn_predict_layers = 1
    config.save_pretrained(directory)
    save_file({**base, **mtp}, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return donor, mtp


def load_target(directory: str) -> TargetModel:
    model = AutoModelForCausalLM.from_pretrained(directory)  # the MTP tensors are unexpected keys to transformers
    return TargetModel(model, name_or_path=directory)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """layout -> (target directory, TargetModel, donor, MTP tensors); built once per layout."""
    built = {}

    def get(layout):
        if layout not in built:
            directory = str(tmp_path_factory.mktemp(layout) / "target")
            donor, mtp = write_native_target(directory, layout)
            built[layout] = (directory, load_target(directory), donor, mtp)
        return built[layout]

    return get


def features(target, drafter, input_ids, loss_mask=None):
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "loss_mask": torch.ones_like(input_ids) if loss_mask is None else loss_mask}
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    return batch


def rms(x, weight, zero_centred=False, eps=1e-6):
    scale = 1 + weight if zero_centred else weight
    return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def causal(length: int, dtype) -> torch.Tensor:
    """An additive causal mask [1, 1, T, T] (works with eager and SDPA attention alike)."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.zeros(length, length, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]


# ---- the training forward on a from-scratch drafter ------------------------------------------------------------------
def naive_cell_logits(drafter, input_ids, hidden, row: int, position: int, depth: int) -> torch.Tensor:
    """Depth `depth` at `position`, recomputing every depth over the prefix 0..position from scratch: depth j reads
    the tokens x_{p+j+1} and depth j-1's output (fed back normed or pre-norm), module j, causal over the prefix."""
    embed = drafter.target_info.embed_weight
    h = hidden[row, : position + 1][None]
    positions = torch.arange(position + 1)[None]
    for j in range(depth + 1):
        module = drafter.layers[j % drafter.config.num_modules]
        e = embed[input_ids[row, j + 1 : j + 2 + position]][None].to(h.dtype)
        if drafter.config.layout in ("deepseek_v3", "mimo"):
            e[:, 0] = 0.0  # the embedding at position 0 is zeroed
        parts = [module.enorm(e), module.hnorm(h)]
        x = module.eh_proj(torch.cat(parts if drafter.config.layout != "mimo" else parts[::-1], dim=-1))
        y = module.block(x, attention_mask=causal(position + 1, x.dtype), position_ids=positions,
                         position_embeddings=drafter.rotary(x, positions))
        normed = module.final_norm(y)
        h = y if drafter.config.layout == "deepseek_v3" else normed
    return normed[0, -1] @ drafter.target_info.lm_head_weight.T


@pytest.mark.parametrize("layout,reuse", [("deepseek_v3", False), ("speculators", True)])
def test_training_forward_equals_naive_per_cell_reference(layout, reuse):
    target = TargetModel(make_tiny_model("llama", num_layers=2), name_or_path="tiny")
    torch.manual_seed(3)
    config = MTPConfig(num_modules=1 if reuse else 3, reuse=reuse, num_steps=3, layout=layout,
                       proposer="depths")  # the reference's definition; the served steps: test_server_*
    drafter = MTPDrafter(config, target.target_info()).double()
    input_ids = torch.randint(3, 250, (2, 11))
    loss_mask = torch.ones_like(input_ids)
    loss_mask[1, :6] = 0  # a prompt: rows whose labels all sit in it carry no loss
    batch = features(target, drafter, input_ids, loss_mask)
    batch["attention_mask"][1, 9:] = 0  # right padding
    with torch.no_grad():
        output = drafter(batch)
    lengths = [11, 9]
    checked = 0
    for n in range(output.logits.shape[0]):
        row, position = int(output.batch_index[n]), int(output.label_position[n, 0]) - 2
        for depth in range(3):
            label = position + depth + 2
            expected_valid = label < lengths[row] and bool(loss_mask[row, label])
            assert bool(output.depth_valid[n, depth]) == expected_valid
            if not expected_valid:
                continue
            assert int(output.label_position[n, depth]) == label
            expected = naive_cell_logits(drafter, input_ids, batch["final_hidden"], row, position, depth)
            torch.testing.assert_close(output.logits[n, depth], expected, rtol=1e-9, atol=1e-9)
            checked += 1
    assert checked == sum(1 for r in range(2) for p in range(11) for d in range(3)
                          if p + d + 2 < lengths[r] and loss_mask[r, p + d + 2])


def test_loss_is_the_weighted_per_depth_mean_of_soft_or_hard_cross_entropy():
    target = TargetModel(make_tiny_model("llama", num_layers=2), name_or_path="tiny")
    input_ids = torch.randint(3, 250, (2, 10))
    with torch.no_grad():
        target_logits = target.model(input_ids=input_ids).logits
    for loss_kind, weights in (("soft", ()), ("hard", (0.51, 0.31, 0.18))):
        drafter = MTPDrafter(MTPConfig(num_modules=3, loss=loss_kind, loss_weights=weights), target.target_info())
        batch = features(target, drafter.double(), input_ids)
        output = drafter(batch)
        loss, metrics = drafter.loss(output, batch)
        expected = 0.0
        for depth, weight in enumerate(weights or [1 / 3] * 3):
            valid = output.depth_valid[:, depth]
            logits = output.logits[valid, depth]
            rows, labels = output.batch_index[valid], output.label_position[valid, depth]
            if loss_kind == "soft":
                teacher = torch.softmax(target_logits[rows, labels - 1], dim=-1)
                cells = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1)
            else:
                cells = F.cross_entropy(logits, input_ids[rows, labels], reduction="none")
            expected = expected + weight * cells.mean()
            assert metrics[f"loss_{depth}"] == pytest.approx(float(cells.mean().detach()), rel=1e-9)
        torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)


# ---- native layouts --------------------------------------------------------------------------------------------------
def reference_logits(layout, donor, mtp, input_ids, hidden, lm_head, depth: int):
    """The checkpoint's module as its model defines it, written out here: depth 0 reads the target's final hidden
    state, depth 1 the module's own output (DeepSeek-V3: pre-norm; Qwen3-Next, MiMo: after the final norm), tokens
    shifted by one more. Returns logits [B, T - 1 - depth, V] at positions 0..T-2-depth."""
    fixed_prefix, _, roles = NAMES[layout]
    zero_centred = layout == "qwen3_next"
    length = input_ids.shape[1] - 1
    positions = torch.arange(length)[None].expand(input_ids.shape[0], length)
    block = donor.model.layers[NUM_LAYERS]
    h = hidden[:, :length]
    for j in range(depth + 1):
        e = donor.model.embed_tokens(input_ids[:, 1 + j :])
        h = h[:, : e.shape[1]]
        pos = positions[:, : e.shape[1]]
        if layout != "qwen3_next":
            e = e.masked_fill((pos == 0)[..., None], 0.0)
        parts = [rms(e, mtp[fixed_prefix + roles["enorm"]], zero_centred),
                 rms(h, mtp[fixed_prefix + roles["hnorm"]], zero_centred)]
        x = torch.cat(parts[::-1] if layout == "mimo" else parts, dim=-1) @ mtp[fixed_prefix + roles["proj"]].T
        y = block(x, attention_mask=causal(x.shape[1], x.dtype), position_ids=pos,
                  position_embeddings=donor.model.rotary_emb(x, pos))
        normed = rms(y, mtp[fixed_prefix + roles["final"]], zero_centred)
        h = y if layout == "deepseek_v3" else normed
    return normed @ lm_head.T


@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_module_logits_equal_the_reference_forward(native, layout):
    directory, target, donor, mtp = native(layout)
    drafter = load_drafter("native-mtp", target.target_info())
    assert drafter.kind == "mtp" and drafter.config.layout == layout and drafter.config.num_modules == 1
    assert drafter.max_draft_tokens() is None  # one module, reused for every step as vLLM does
    drafter.config.num_steps = 2
    drafter.config.proposer = "depths"  # the reference's definition of depth 1 (the served steps: test_server_*)
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    batch = features(target, drafter, input_ids)
    with torch.no_grad():
        output = drafter(batch)
        for depth in range(2):
            expected = reference_logits(layout, donor, mtp, input_ids, batch["final_hidden"],
                                        target.model.lm_head.weight, depth)
            valid = output.depth_valid[:, depth]
            rows, positions = output.batch_index[valid], output.label_position[valid, depth] - 2 - depth
            torch.testing.assert_close(output.logits[valid, depth], expected[rows, positions], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_export_round_trip_is_bitwise(native, layout, tmp_path):
    directory, target, _, mtp = native(layout)
    drafter = MTPDrafter.from_target(target.target_info())
    drafter.save(str(tmp_path / "out"), layout)
    source_index, out_index = checkpoint_index(directory), checkpoint_index(str(tmp_path / "out"))
    assert set(out_index) == set(source_index)
    source, written = read_tensors(directory, source_index, source_index), read_tensors(
        str(tmp_path / "out"), out_index, out_index)
    for name, tensor in source.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    assert find_native(str(tmp_path / "out"), NUM_LAYERS).layout == layout


def test_fine_tuned_module_exports_into_the_target_and_reads_back(native, tmp_path):
    """A fine-tune changes the module; the export carries the change into the target's checkpoint, the rest of the
    target stays bitwise, and native-mtp on the exported directory is the fine-tuned drafter; greedy decoding
    through the engine stays lossless."""
    directory, target, _, mtp = native("mimo")
    drafter = MTPDrafter(MTPConfig(layout="mimo", init_from_native=True, reuse=True, num_steps=2),
                         target.target_info())
    drafter.init_from_data(torch.zeros(64))  # the hook training calls before the first step
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    drafter.save(str(tmp_path / "tuned"), "mimo")
    tuned = load_target(str(tmp_path / "tuned"))
    back = load_drafter("native-mtp", tuned.target_info())
    for (name, ours), theirs in zip(drafter.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours, theirs), name
    written = load_file(str(tmp_path / "tuned" / "model-mtp.safetensors"))
    assert not torch.equal(written["model.mtp_layers.0.input_proj.weight"], mtp["model.mtp_layers.0.input_proj.weight"])
    for name, tensor in target.model.state_dict().items():
        assert torch.equal(tuned.model.state_dict()[name], tensor), name
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    plain = speculative_generate(tuned, None, prompts, num_draft_tokens=0, max_new_tokens=12)
    spec = speculative_generate(tuned, back, prompts, num_draft_tokens=3, max_new_tokens=12)
    assert spec.tokens == plain.tokens


def test_deepseek_native_decodes_losslessly_through_the_engine(native):
    _, target, _, _ = native("deepseek_v3")
    drafter = load_drafter("native-mtp", target.target_info())
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8]]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=12)
    spec = speculative_generate(target, drafter, prompts, num_draft_tokens=2, max_new_tokens=12)
    assert spec.tokens == plain.tokens


def test_speculators_layout_round_trips_and_refuses_other_conventions(native, tmp_path):
    _, target, _, _ = native("qwen3_next")
    with pytest.raises(ValueError, match="drafter.layout 'qwen3_next'"):
        load_drafter("native-mtp", target.target_info()).save(str(tmp_path / "x"), "deepseek_v3")
    drafter = MTPDrafter(MTPConfig(layout="qwen3_next", init_from_native=True, reuse=True, num_steps=2),
                         target.target_info())
    drafter.import_native()
    drafter.save(str(tmp_path / "spec"), "speculators")
    with open(tmp_path / "spec" / "config.json") as f:
        config = json.load(f)
    assert "model_type" not in config and config["speculators_model_type"] == "mtp"
    assert config["num_nextn_predict_layers"] == 1 and config["transformer_layer_config"]["model_type"] == "qwen3_next"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    names = set(load_file(str(tmp_path / "spec" / "model.safetensors")))
    assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.token_layernorm.weight",
            "mtp_layers.0.hidden_layernorm.weight", "mtp_layers.0.final_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = load_drafter(str(tmp_path / "spec"), target.target_info())
    assert loaded.config.layout == "speculators" and loaded.num_steps == 2
    batch = features(target, drafter, torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, drafter(batch).logits, rtol=0, atol=0)


def test_from_scratch_heads_export_into_a_llama_target_and_read_back(tmp_path):
    """MTP-2 trained from scratch on a Llama target, exported in the DeepSeek-V3 layout, is found again by
    native-mtp in the written checkpoint (with the same training logits)."""
    model = make_tiny_model("llama", num_layers=2, dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "llama"))
    target = load_target(str(tmp_path / "llama"))
    torch.manual_seed(0)
    drafter = MTPDrafter(MTPConfig(num_modules=2), target.target_info())
    for module in drafter.layers:  # fresh modules pass the hidden state through eh_proj (embedding first)
        assert torch.equal(module.eh_proj.weight[:, 64:], torch.eye(64))
    drafter.save(str(tmp_path / "with_mtp"), "deepseek_v3")
    exported = load_target(str(tmp_path / "with_mtp"))
    back = load_drafter("native-mtp", exported.target_info())
    assert back.config.num_modules == 2 and back.config.proposer == "server"  # proposing as vLLM runs it
    back.config.reuse, back.config.num_steps, back.config.proposer = False, 2, "depths"  # both depths' training logits
    batch = features(target, drafter, torch.randint(3, 250, (2, 10)))
    with torch.no_grad():
        torch.testing.assert_close(back(batch).logits, drafter(batch).logits, rtol=0, atol=0)


# ---- bad input -------------------------------------------------------------------------------------------------------
def test_a_checkpoint_without_mtp_weights_says_what_was_looked_for_and_found(tmp_path):
    make_tiny_model("llama", num_layers=2, dtype=torch.float32).save_pretrained(str(tmp_path / "plain"))
    target = load_target(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"no MTP weights.*deepseek_v3.*qwen3_next.*mimo.*found only: "
                                         r".*model\.layers\.\{i\}"):
        load_drafter("native-mtp", target.target_info())
    drafter = MTPDrafter(MTPConfig(init_from_native=True), target.target_info())
    with pytest.raises(ValueError, match="no MTP weights"):
        drafter.init_from_data(torch.zeros(256))


def test_a_layout_that_does_not_match_the_declared_family_is_refused(native, tmp_path):
    directory, target, _, mtp = native("deepseek_v3")
    with pytest.raises(ValueError, match="drafter.layout is 'mimo'.*deepseek_v3 layout"):
        MTPDrafter(MTPConfig(layout="mimo", init_from_native=True), target.target_info()).import_native()
    with pytest.raises(ValueError, match="drafter.num_modules is 2.*1 MTP module"):
        MTPDrafter(MTPConfig(num_modules=2, init_from_native=True), target.target_info()).import_native()
    # a DeepSeek-V3 checkpoint (model_type deepseek_v3) whose MTP tensors are in the MiMo layout
    stored = load_file(os.path.join(directory, "model.safetensors"))
    renamed = {name.replace(P, "model.mtp_layers.0.").replace("eh_proj", "input_proj"): t
               for name, t in stored.items()}
    os.makedirs(tmp_path / "odd")
    save_file(renamed, str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' ships MTP weights in the deepseek_v3 layout, but "
                                         "this checkpoint holds the mimo layout"):
        find_native(str(tmp_path / "odd"), NUM_LAYERS, "deepseek_v3")


def test_depth_beyond_the_modules_without_reuse_names_the_field():
    info = TargetModel(make_tiny_model("llama", num_layers=2), name_or_path="tiny").target_info()
    with pytest.raises(ValueError, match="drafter.num_steps 3 exceeds drafter.num_modules 2.*drafter.reuse"):
        MTPDrafter(MTPConfig(num_modules=2, num_steps=3), info)
    with pytest.raises(ValueError, match="drafter.loss_weights has 1 entries for 2 steps"):
        drafter = MTPDrafter(MTPConfig(num_modules=2, loss_weights=(1.0,)), info)
        batch = features(TargetModel(make_tiny_model("llama", num_layers=2), name_or_path="tiny"), drafter.double(),
                         torch.randint(3, 250, (1, 8)))
        drafter.loss(drafter(batch), batch)
    with pytest.raises(ValueError, match="--format qwen3_next carries exactly one MTP module"):
        MTPDrafter(MTPConfig(num_modules=2, layout="qwen3_next"), info).save("/nonexistent", "qwen3_next")


def test_server_steps_equal_the_module_run_autoregressively_over_the_committed_prefix():
    """proposer "server" (one module, as vLLM and SGLang run it; vLLM's own acceptance is compared in
    tests/test_serve_check.py): draft 1 is step 0 at the last committed position; draft j + 1 is the module at the
    next position over draft j and the previous output, attending to the committed prefix's step-0 states and the
    steps before it. Written out here as one causal forward per draft, without the proposer's cache, over rounds with
    forced accept counts (rejections, a row that stops early)."""
    from test_contract import NUM_DRAFTS, decode_with_forced_accepts, tiny_target

    target = tiny_target()
    torch.manual_seed(3)
    drafter = MTPDrafter(MTPConfig(num_modules=1, reuse=True), target.target_info()).double().eval()
    assert drafter.served_steps
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    prompts, schedules = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90, 3]], [[2, 0, 1, 3], [1, 3, None, None]]
    with torch.no_grad():
        sequences, rounds = decode_with_forced_accepts(target, drafter, prompts, schedules)
        checked = 0
        for row, row_rounds in enumerate(rounds):
            ids = torch.tensor([sequences[row]])
            hidden = features(target, drafter, ids)["final_hidden"]
            for anchor, proposed, _ in row_rounds:
                tokens, inputs = ids[:, 1:anchor + 1], hidden[:, :anchor]  # step 0 at 0 .. anchor - 1
                for j in range(NUM_DRAFTS):
                    length = tokens.shape[1]
                    fed, normed = drafter._step(0, tokens, inputs, torch.arange(length)[None],
                                                causal_mask(length, "cpu"))
                    assert int(drafter._logits(normed[:, -1]).argmax()) == proposed[j], (row, anchor, j)
                    tokens = torch.cat([tokens, torch.tensor([[proposed[j]]])], dim=1)
                    inputs = torch.cat([inputs, fed[:, -1:]], dim=1)
                    checked += 1
    assert checked == 6 * NUM_DRAFTS
    # several modules, as servers run them: the first at every step, the others never (whatever their weights)
    several = MTPDrafter(MTPConfig(num_modules=2, proposer="server"), target.target_info()).double().eval()
    assert several.max_draft_tokens() is None
    several.load_state_dict(drafter.state_dict(), strict=False)
    with torch.no_grad():
        for parameter in several.layers[1].parameters():
            parameter.add_(torch.randn_like(parameter))
        assert decode_with_forced_accepts(target, several, prompts, schedules) == (sequences, rounds)
    with pytest.raises(ValueError, match="drafter.proposer 'server' trains one module.*num_modules is 2"):
        several(features(target, several, torch.tensor([sequences[0]])))
    from train.config import load_recipe

    with pytest.raises(ValueError, match="drafter.proposer 'server' trains one module.*num_modules is 3"):
        load_recipe(os.path.join(os.path.dirname(__file__), "..", "recipes", "debug", "tiny_mtp.yaml"),
                    ["drafter.num_modules=3", "drafter.proposer=server"])


@pytest.mark.parametrize("layout,family", [("deepseek_v3", "deepseek_v3"), ("deepseek_v3", "llama"),
                                           ("mimo", "llama")])
def test_server_proposals_equal_the_training_forward(layout, family):
    """Training teaches the steps the server runs (layers.StepKeys): wherever a round's drafts up to step k were
    accepted, the training forward's step-k prediction is the proposal (test_contract's check for the other kinds),
    with either fed-back state and position-0 masking. The state a step feeds to the next is the server's: the
    normed output in vLLM 0.32's DeepSeek MTP model (a DeepSeek-V3 target) and MiMo's (tests/test_serve_check.py
    serves both); the layout's own pre-norm one on a family no server runs it for (Llama)."""
    from test_contract import NUM_DRAFTS, assert_proposals_are_training_predictions, tiny_target

    target = tiny_target() if family == "llama" else TargetModel(make_tiny_model(family, num_layers=2),
                                                                 name_or_path=f"tiny-{family}")
    torch.manual_seed(4)
    drafter = MTPDrafter(MTPConfig(num_modules=1, reuse=True, num_steps=NUM_DRAFTS, layout=layout),
                         target.target_info()).double().eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        ids = torch.tensor([[5, 17, 33, 9]])
        fed, normed = drafter._step(0, ids, features(target, drafter, ids)["final_hidden"], torch.arange(4)[None],
                                    causal_mask(4, "cpu"))
        assert torch.equal(fed, normed) == (family != "llama" or layout == "mimo")
    assert_proposals_are_training_predictions(target, drafter)


def test_fp8_mtp_weights_are_refused(native, tmp_path):
    directory, _, _, _ = native("mimo")
    stored = load_file(os.path.join(directory, "model.safetensors"))
    stored["model.mtp_layers.0.input_proj.weight_scale_inv"] = torch.ones(1)
    os.makedirs(tmp_path / "fp8")
    save_file(stored, str(tmp_path / "fp8" / "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f, open(tmp_path / "fp8" / "config.json", "w") as g:
        g.write(f.read())
    info = dataclasses.replace(load_target(directory).target_info(), name_or_path=str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match="FP8-quantised"):
        MTPDrafter.from_target(info)


def test_doctor_checks_of_the_speculators_layout(tmp_path):
    """`draftsmith doctor`'s format checks (drafters/mtp/readers.py): a good export passes; a verifier config of
    another size and a missing module tensor fail naming the field."""
    target = TargetModel(make_tiny_model("llama", num_layers=2, dtype=torch.float32), name_or_path="tiny-llama")
    torch.manual_seed(0)
    MTPDrafter(MTPConfig(layout="speculators", reuse=True, num_steps=2), target.target_info()).save(
        str(tmp_path / "good"), "speculators")

    def checks(directory):
        return {row.name: row for row in MTPDrafter.export_module.export_checks(str(directory), target.target_info())}

    good = checks(tmp_path / "good")
    assert [row.status for row in good.values()] == ["pass"] * 4, good
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    config["transformer_layer_config"]["hidden_size"] = 48
    tensors = load_file(str(tmp_path / "good" / "model.safetensors"))
    del tensors["mtp_layers.0.token_layernorm.weight"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    bad = checks(tmp_path / "bad")
    assert bad["sizes"].status == "fail" and "transformer_layer_config.hidden_size 48 != the target's 64" in \
        bad["sizes"].detail and "mtp_layers.0.token_layernorm.weight has shape None" in bad["sizes"].detail
    assert bad["reader draftsmith"].status == "fail"
