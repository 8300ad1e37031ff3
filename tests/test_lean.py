"""The lean decode forward (inference/engine/cpu/lean.py): it runs where the structure and the probe allow and nowhere
else, its logits and served features sit within float32 rounding of the model's own forward, its masks are the
ragged cache's, and greedy speculative decoding over it stays lossless with holes in the cache (batch > 1)."""

import copy

import pytest
import torch
from conftest import make_tiny_model, random_prompts
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from drafters import DraftModelDrafter
from drafters.base import FeatureRequest
from drafters.draft_model import DraftModelConfig
from inference.engine.api import speculative_generate
from inference.engine.cpu.lean import block_mask
from inference.engine.target import TargetModel

LEAN, HF_DECODE = "lean", "hf"  # what TargetModel.decode says runs the blocks after the prefill

# as tests/test_fastpath.py: float32 forwards summed in different orders, against a float64 reference
TOL = 2**7 * torch.finfo(torch.float32).eps


def pair(arch: str, backend):
    model = make_tiny_model(arch, dtype=torch.float32)
    return TargetModel(copy.deepcopy(model), backend=backend), model.double()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lean_blocks_and_features_are_within_float32_rounding_of_float64(arch, cpu_backend):
    lean, reference = pair(arch, cpu_backend)
    assert lean.decode == LEAN and lean.lean_refused is None
    ids = torch.tensor([random_prompts(1, seed=4, min_len=40, max_len=40)[0]])
    with torch.no_grad():
        out = reference(input_ids=ids, output_hidden_states=True)
    request = FeatureRequest(layer_ids=(0, 1, 2), final_hidden=True)
    logits, served = [lean.prefill(ids[:, :30], torch.ones_like(ids[:, :30]), request)[0]], []
    for start, stop in ((30, 31), (31, 33), (33, 40)):
        block_logits, features = lean.extend(ids[:, start:stop], request)
        logits.append(block_logits)
        served.append(features)
    scale = float(out.logits.abs().max())
    got = torch.cat(logits, dim=1).double()
    torch.testing.assert_close(got, out.logits[:, 29:], rtol=TOL, atol=TOL * scale)
    for layer_id in (0, 1):  # layer i's input is hidden_states[i]
        want = out.hidden_states[layer_id][:, 30:]
        got = torch.cat([f.hidden[layer_id] for f in served], dim=1).double()
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * float(want.abs().max()))
    before_norm = torch.cat([f.hidden[2] for f in served], dim=1)  # id 2 = the final norm's input
    torch.testing.assert_close(lean.final_norm(before_norm), torch.cat([f.final_hidden for f in served], dim=1),
                               rtol=TOL, atol=TOL)
    final = torch.cat([f.final_hidden for f in served], dim=1).double()
    torch.testing.assert_close(final, out.hidden_states[-1][:, 30:], rtol=TOL,
                               atol=TOL * float(out.hidden_states[-1].abs().max()))


def test_on_the_fast_path_each_layers_projections_run_stacked_over_one_copy_of_the_weights(cpu_backend):
    model = make_tiny_model("qwen3", dtype=torch.float32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    target = TargetModel(model, backend=cpu_backend)
    assert target.decode == LEAN
    assert set(target.model.state_dict()) == set(before)
    for name, tensor in target.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for layer, weights in zip(target.model.model.layers, target.runner.block_forward.layers):
        for members, stacked in (((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                  weights.qkv), ((layer.mlp.gate_proj, layer.mlp.up_proj), weights.gate_up)):
            assert stacked.out_features == sum(m.out_features for m in members)
            start = stacked.weight.data_ptr()
            for member in members:  # a view into the stacked weight, no layout of its own
                assert member.weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()
                assert member.weight.data_ptr() == start and member.copies == {"weight": None}
                start += member.weight.numel() * member.weight.element_size()
    assert target.prepared.kernels.stacked and "stacked" in target.prepared.kernels.as_dict()


def test_the_probe_refuses_a_model_that_computes_what_the_lean_forward_does_not(cpu_backend):
    class OffsetNorm(LlamaRMSNorm):  # an RMSNorm with a (1 + weight) gain, as Gemma's: same names, other arithmetic
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 1.5

    model = make_tiny_model("llama", dtype=torch.float32)
    old = model.model.layers[1].post_attention_layernorm
    norm = OffsetNorm(old.weight.shape[0], eps=old.variance_epsilon)
    norm.weight = old.weight
    model.model.layers[1].post_attention_layernorm = norm
    target = TargetModel(model, backend=cpu_backend)
    assert target.decode == HF_DECODE and "differ from the model's" in target.lean_refused
    assert target.runner.block_forward is None


def test_structures_it_does_not_know_keep_the_hf_decode(cpu_backend):
    target = TargetModel(make_tiny_model("mistral", dtype=torch.float32), backend=cpu_backend)  # sliding window
    assert target.decode == HF_DECODE and "sliding_attention" in target.lean_refused
    plain = TargetModel(make_tiny_model("llama", dtype=torch.float32))  # the default backend: the model's own
    assert plain.decode == HF_DECODE and plain.lean_refused == "the lean forward is off"


def test_the_block_mask_is_the_ragged_cache_causal_mask_over_valid_slots():
    slots = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1]])
    assert block_mask(slots[:1], 1) is None  # one token, no holes: every key
    mask = block_mask(slots, 2)[:, 0]  # queries in slots 2, 3
    want = torch.tensor([[[1, 1, 1, 0], [1, 1, 1, 1]],
                         [[0, 1, 1, 0], [0, 1, 0, 1]]], dtype=torch.bool)  # row 1: a padding query sees itself
    assert torch.equal(mask, want)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_speculative_decoding_over_the_lean_forward_equals_its_plain_greedy(batch_size, cpu_backend):
    target = TargetModel(make_tiny_model("qwen3", dtype=torch.float32), backend=cpu_backend)
    assert target.decode == LEAN
    drafter = DraftModelDrafter(DraftModelConfig(path="tiny"), target.target_info(),
                                model=make_tiny_model("qwen3", seed=5, num_layers=1, dtype=torch.float32))
    prompts = random_prompts(3, seed=2)
    plain = [speculative_generate(target, None, [p], num_draft_tokens=0, max_new_tokens=30).tokens[0] for p in prompts]
    for k in (1, 4):
        for start in range(0, 3, batch_size):
            out = speculative_generate(target, drafter, prompts[start:start + batch_size], num_draft_tokens=k,
                                       max_new_tokens=30)
            assert out.tokens == plain[start:start + batch_size], k
