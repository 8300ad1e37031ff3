"""The KV-sharing assistant (drafters/assistant/): attention over the engine's live, ragged target cache equals a
naive reference over K/V recomputed from scratch; the drafter never writes the cache; training's K/V capture equals
the engine's cache; bad input names the field; the debug recipe trains and exports through the real loop; a tiny
Gemma 4 assistant written by transformers is read, drafts what transformers' forward computes, and round-trips.

The shared contract (tests/test_contract.py) covers shapes, gradients, proposals == the training forward, lossless
output and persistence; this file adds what is specific to reading another model's cache.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model

from drafters.assistant import AssistantConfig, AssistantDrafter
from drafters.base import DraftContext, FeatureRequest
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider, training_request

NUM_DRAFTS = 3


def tiny(arch: str = "llama") -> TargetModel:
    return TargetModel(make_tiny_model(arch, num_layers=4), name_or_path=f"tiny-{arch}")


def assistant(target: TargetModel, seed: int = 1, **overrides) -> AssistantDrafter:
    torch.manual_seed(seed)
    config = AssistantConfig(**{"num_layers": 2, "hidden_size": 48, "intermediate_size": 96, "kv_layers": (1, 3),
                                **overrides})
    drafter = AssistantDrafter(config, target.target_info()).double()
    with torch.no_grad():  # unit norms everywhere would hide a norm applied to the wrong tensor
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return drafter.eval()


def naive_logits(drafter: AssistantDrafter, target: TargetModel, sequence: list[int], num_steps: int,
                 drafts: list[int]) -> torch.Tensor:
    """Reference for one row, from scratch: the target's K/V of `sequence` (a plain HF forward with output of its
    attention inputs recomputed by hand), then num_steps assistant steps written out with explicit softmax attention.
    The anchor is sequence[-1]; the hidden state is the target's final (normed) hidden state at sequence[-2]."""
    model = target.model
    ids = torch.tensor([sequence[:-1]])
    out = model(input_ids=ids, output_hidden_states=True)
    h = out.hidden_states[-1][0, -1]  # [D] after the final norm
    num_cached = ids.shape[1]
    positions = torch.arange(num_cached)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim))

    def rotate(x, pos):  # x [heads, n, d] rotated at positions pos [n] (rotate-half)
        angles = pos.double()[:, None] * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        return x * cos + torch.cat([-x[..., head_dim // 2:], x[..., : head_dim // 2]], -1) * sin

    def target_kv(layer):  # keys/values [H_kv, C, d] of decoder layer `layer`, recomputed from its input
        attn = model.model.layers[layer].self_attn
        x = model.model.layers[layer].input_layernorm(out.hidden_states[layer][0])
        k = attn.k_proj(x).view(num_cached, -1, head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(num_cached, -1, head_dim).transpose(0, 1)
        return rotate(k, positions), v

    def rms(x, weight, eps):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    eps = drafter.target_info.rms_norm_eps
    embed = model.model.embed_tokens.weight
    token, hidden, logits = sequence[-1], h, []
    for step in range(num_steps):
        x = drafter.pre_projection.weight @ torch.cat([embed[token], hidden])
        for layer, target_layer in zip(drafter.layers, drafter.kv_layers):
            k, v = target_kv(target_layer)
            q = (layer.self_attn.q_proj.weight @ rms(x, layer.input_layernorm.weight, eps)).view(-1, 1, head_dim)
            q = rotate(q, torch.tensor([num_cached]))  # the constant query position: the anchor's
            groups = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim), dim=-1)  # [H, 1, C]
            x = x + layer.self_attn.o_proj.weight @ (weights @ v).reshape(-1)
            y = rms(x, layer.post_attention_layernorm.weight, eps)
            mlp = layer.mlp
            x = x + mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ y) * (mlp.up_proj.weight @ y))
        normed = rms(x, drafter.norm.weight, eps)
        logits.append(drafter.lm_head.weight @ normed)
        hidden = drafter.post_projection.weight @ normed
        token = drafts[step]  # the next step reads the draft the drafter chose
    return torch.stack(logits)


@torch.no_grad()
def test_logits_over_the_live_ragged_cache_equal_a_reference_recomputed_from_scratch():
    """Three left-padded rows accept different numbers of drafts per round, so the engine's cache holds holes (rejected
    drafts of one row kept as slots for another); every proposal's logits must equal the naive reference that
    recomputes the target's K/V of the row's accepted sequence alone."""
    target = tiny()
    drafter = assistant(target)
    prompts = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90, 3], [8, 200, 13]]
    schedule = [[0, 3, 1, 2], [2, 0, 3, 0], [3, 1, 0, 2]]  # drafts accepted per row per round
    request = drafter.feature_request()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
    _, served = target.prefill(ids, mask, request)
    gen = torch.Generator().manual_seed(0)
    bonus = torch.randint(3, 250, (len(prompts),), generator=gen)
    drafter.begin(DraftContext(ids, mask.bool(), (mask.cumsum(-1) - 1).clamp(min=0), next_tokens=bonus,
                               **served.context()))
    sequences = [list(p) for p in prompts]
    saw_holes = False
    for step in range(len(schedule[0])):
        drafts, logits, _ = drafter.draft_logits(NUM_DRAFTS)
        for row in range(len(prompts)):
            expected = naive_logits(drafter, target, sequences[row] + [int(bonus[row])], NUM_DRAFTS,
                                    drafts[row].tolist())
            torch.testing.assert_close(logits[row], expected, rtol=1e-9, atol=1e-9)
        accepted = torch.tensor([s[step] for s in schedule])
        block = torch.cat([bonus[:, None], drafts], dim=1)
        mark = target.mark()
        _, served = target.extend(block, request)
        target.keep_after(mark, accepted + 1)
        served = served.with_kv(target.kv_view(request.kv_layers))
        slots = target.runner.slot_mask
        saw_holes |= bool((slots[:, :-1] > slots[:, 1:]).any())  # a dropped slot followed by a kept one
        for row in range(len(prompts)):
            sequences[row] += block[row, : int(accepted[row]) + 1].tolist()
        valid = torch.arange(NUM_DRAFTS + 1)[None] <= accepted[:, None]
        positions = target.runner.lengths[:, None] - valid.long().sum(-1, keepdim=True) + torch.arange(NUM_DRAFTS + 1)
        bonus = torch.randint(3, 250, (len(prompts),), generator=gen)
        drafter.commit(accepted, DraftContext(block, valid, positions, next_tokens=bonus, **served.context()))
    assert saw_holes, "the schedule must leave holes in the ragged cache"


@torch.no_grad()
def test_propose_never_changes_the_live_target_cache():
    target = tiny()
    drafter = assistant(target)
    request = drafter.feature_request()
    prompt = torch.tensor([[5, 17, 33, 9, 120, 41, 7], [0, 0, 250, 11, 64, 90, 3]])
    mask = (prompt != 0).long()
    _, served = target.prefill(prompt, mask, request)
    drafter.begin(DraftContext(prompt, mask.bool(), (mask.cumsum(-1) - 1).clamp(min=0),
                               next_tokens=torch.tensor([4, 5]), **served.context()))
    layers = target.runner.cache.layers
    before = [(layer.keys.clone(), layer.values.clone(), layer.keys._version, layer.values._version)
              for layer in layers]
    slot_mask = target.runner.slot_mask.clone()
    for _ in range(2):
        drafter.propose(NUM_DRAFTS)
    for layer, (keys, values, key_version, value_version) in zip(layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert (layer.keys._version, layer.values._version) == (key_version, value_version)  # no in-place write
    assert torch.equal(target.runner.slot_mask, slot_mask)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_training_kv_capture_equals_the_engine_cache(arch):
    """TargetModel.features serves the same K/V (normed and rotated, Qwen3's k_norm included) as the engine's cache
    after a prefill of the same tokens; padding slots are zeroed in training batches."""
    target = tiny(arch)
    ids = torch.tensor([[5, 17, 33, 9, 120, 41], [250, 11, 64, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    request = FeatureRequest(final_hidden=True, kv_layers=(0, 3))
    batch = {"input_ids": ids, "attention_mask": mask}
    served = FeatureProvider("online", target, request).online(batch)["target_kv"]
    for row, length in enumerate((6, 3)):
        _, engine = target.prefill(ids[row : row + 1, :length], mask[row : row + 1, :length], request)
        for layer in (0, 3):
            for ours, theirs in zip(served[layer], engine.target_kv[layer]):
                torch.testing.assert_close(ours[row, :, :length], theirs[0].float(), rtol=1e-6, atol=1e-6)
                assert not ours[row, :, length:].any()


def test_qwen3_targets_get_per_head_query_norms():
    drafter = assistant(tiny("qwen3"))
    assert drafter.shape.qk_norm and drafter.shape.head_dim == 16
    assert all(layer.self_attn.q_norm is not None for layer in drafter.layers)
    assert assistant(tiny("llama")).layers[0].self_attn.q_norm is None


def test_bad_input_names_the_field():
    target = tiny()
    info = target.target_info()
    with pytest.raises(ValueError, match=r"drafter.kv_layers \[4\] do not exist: the target has layers 0..3"):
        AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(1, 4)), info)
    with pytest.raises(ValueError, match="drafter.kv_layers has 1 entries for drafter.num_layers 2"):
        AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(1,)), info)
    # a target whose layer 3 caches keys of another head dim (as Gemma's global layers do)
    name = "model.layers.3.self_attn.k_proj.weight"
    weights = {**info.weights, name: torch.zeros(2 * 32, info.hidden_size)}
    other = dataclasses.replace(info, weights=weights)
    with pytest.raises(ValueError, match="drafter.kv_layers: target layer 3 caches keys of width 64, not 2 heads x "
                                         "head dim 16"):
        AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(1, 3)), other)
    AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(1, 2)), other)  # layers 1 and 2 are fine


def test_kv_layers_are_served_online_only():
    request = FeatureRequest(final_hidden=True, kv_layers=(3,))
    assert training_request(request, "online").kv_layers == (3,)
    for mode in ("offline", "hybrid"):
        with pytest.raises(ValueError, match=f"^features.mode={mode}: .*set features.mode: online$"):
            training_request(request, mode)


def test_debug_recipe_trains_and_exports(tmp_path):
    """recipes/debug/tiny_assistant.yaml through the real loop (a few steps on seeded chats, the debug target), then a
    native export that loads back with identical weights."""
    from test_train import reset_accelerate, tiny_overrides, write_chats

    from drafters import load_drafter
    from inference.assets.debug_target import resolve_debug_target
    from train.build import build_trainer
    from train.config import load_recipe

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(tmp_path / "cache"))
    write_chats(str(tmp_path / "chats.jsonl"))
    overrides = tiny_overrides((tmp_path, target_dir), str(tmp_path / "run"), "train.max_steps=12", "optim.lr=1e-2")
    reset_accelerate()
    trainer = build_trainer(load_recipe(os.path.join(root, "recipes", "debug", "tiny_assistant.yaml"), overrides))
    final_dir = trainer.fit()
    trainer.accelerator.end_training()
    losses = [json.loads(line)["train/loss"] for line in open(tmp_path / "run" / "metrics.jsonl")
              if "train/loss" in line]
    assert len(losses) >= 3 and losses[-1] < losses[0]
    trained = trainer.accelerator.unwrap_model(trainer.drafter)
    trained.save(str(tmp_path / "export"), "native")
    loaded = load_drafter(str(tmp_path / "export"), trainer.target.target_info())
    assert isinstance(loaded, AssistantDrafter)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# ---- Gemma 4: a tiny target and assistant written with transformers' own classes ----------------------------------
GEMMA4 = dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=512,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
TYPES = ["sliding_attention", "full_attention"]


def gemma4_pair(tmp_path):
    """A 4-layer Gemma 4 target (window 64, longer than any test sequence, so its cache keeps every token) and a
    2-layer assistant (window 3, so its sliding layer masks keys) saved with save_pretrained; float64."""
    pytest.importorskip("transformers.models.gemma4_assistant", reason="transformers without Gemma 4 assistants")
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    target = Gemma4ForCausalLM(Gemma4TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                                layer_types=TYPES * 2, sliding_window=64, **GEMMA4))
    text = Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=TYPES,
                            sliding_window=3, **GEMMA4)
    helper = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64))
    with torch.no_grad():  # off the unit-norm, zero-scalar start
        for parameter in helper.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    helper.save_pretrained(str(tmp_path / "assistant"))
    return TargetModel(target.double().eval(), name_or_path="tiny-gemma4"), helper.double().eval()


@torch.no_grad()
def test_gemma4_assistant_drafts_equal_transformers_forward(tmp_path):
    """The imported assistant, run by our engine over the live Gemma 4 target cache (begin / draft_logits), gives
    the logits of transformers' Gemma4AssistantForCausalLM driven as its candidate generator drives it (target
    embedding of the last token, the target's last hidden state, constant position, the target's shared K/V)."""
    from drafters import load_drafter

    target, helper = gemma4_pair(tmp_path)
    drafter = load_drafter(str(tmp_path / "assistant"), target.target_info()).double().eval()
    assert isinstance(drafter, AssistantDrafter) and drafter.kv_layers == (2, 3)  # last sliding, last full
    prompt = torch.tensor([[5, 17, 33, 9, 120, 41, 7, 8, 99]])
    _, served = target.prefill(prompt, torch.ones_like(prompt), drafter.feature_request())
    next_token = torch.tensor([50])
    drafter.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(9)[None],
                               next_tokens=next_token, **served.context()))
    drafts, logits, _ = drafter.draft_logits(NUM_DRAFTS)

    out = target.model(input_ids=prompt, output_hidden_states=True, return_shared_kv_states=True)
    shared = dict(out.shared_kv_states)
    token, hidden = next_token[:, None], out.hidden_states[-1][:, -1:]
    for step in range(NUM_DRAFTS):
        embeds = torch.cat([target.model.get_input_embeddings()(token), hidden], dim=-1)
        reference = helper(inputs_embeds=embeds, attention_mask=torch.ones(1, 9, dtype=torch.long),
                           position_ids=torch.tensor([[9]]), shared_kv_states=shared, use_cache=False)
        # transformers' Gemma 4 RMSNorm computes in float32 even for float64 inputs, hence the tolerance
        torch.testing.assert_close(logits[:, step], reference.logits[:, 0], rtol=0, atol=1e-5)
        token, hidden = reference.logits.argmax(-1), reference.last_hidden_state
        assert int(token) == int(drafts[0, step])


def test_gemma4_assistant_round_trip_is_bitwise_and_lossless(tmp_path):
    """gemma4_assistant -> our drafter -> gemma4_assistant gives the same tensors and text config, transformers loads
    the export, and greedy speculative decoding of the Gemma 4 target with it equals plain greedy decoding."""
    from safetensors.torch import load_file
    from transformers import Gemma4AssistantForCausalLM

    from drafters import load_drafter
    from inference.engine.api import speculative_generate

    target, _ = gemma4_pair(tmp_path)
    drafter = load_drafter(str(tmp_path / "assistant"), target.target_info())
    drafter.save(str(tmp_path / "export"), "gemma4_assistant")
    original = load_file(str(tmp_path / "assistant" / "model.safetensors"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == set(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)
    with open(tmp_path / "assistant" / "config.json") as f, open(tmp_path / "export" / "config.json") as g:
        assert json.load(g)["text_config"] == json.load(f)["text_config"]
    Gemma4AssistantForCausalLM.from_pretrained(str(tmp_path / "export"))
    drafter = drafter.double().eval()
    prompts = [[5, 17, 33, 9, 120], [40, 41, 42]]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=12, eos_token_ids=[])
    spec = speculative_generate(target, drafter, prompts, num_draft_tokens=NUM_DRAFTS, max_new_tokens=12,
                                eos_token_ids=[])
    assert spec.tokens == plain.tokens
    with pytest.raises(ValueError, match="gemma4_assistant export needs an assistant with Gemma 4 layers"):
        assistant(tiny()).save(str(tmp_path / "llama_style"), "gemma4_assistant")
    assert drafter.config.reading == "transformers"  # a released checkpoint's: no draftsmith_reading
    vllm = AssistantDrafter(dataclasses.replace(drafter.config, reading="vllm"), target.target_info())
    vllm.save(str(tmp_path / "vllm"), "gemma4_assistant")
    assert load_drafter(str(tmp_path / "vllm"), target.target_info()).config.reading == "vllm"


@pytest.mark.parametrize("reading", ["transformers", "vllm"])
def test_proposals_equal_the_training_forward_in_either_reading(reading):
    """Wherever a round's drafts up to step k were accepted, the training forward's step-k prediction is the
    proposal (test_contract's check), in transformers' reading (queries one position past the last cached key) and
    in vLLM's (queries at it: AssistantConfig.reading), which differ."""
    from test_contract import NUM_DRAFTS, assert_proposals_are_training_predictions, tiny_target

    target = tiny_target()
    drafters = {}
    for name in ("transformers", reading):
        torch.manual_seed(4)
        drafters[name] = AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(1, 3), num_steps=NUM_DRAFTS,
                                                          reading=name), target.target_info()).double().eval()
    output, batch = assert_proposals_are_training_predictions(target, drafters[reading])
    with torch.no_grad():
        other = drafters["transformers"](batch)
    assert torch.equal(output.logits, other.logits) == (reading == "transformers")
    with pytest.raises(ValueError, match="drafter.reading 'sglang'"):
        AssistantDrafter(AssistantConfig(num_layers=1, reading="sglang"), target.target_info())
