"""The engine: lossless greedy for every drafter, KV rollback, hidden-state capture, and a whole-loop sampling test."""

import copy

import pytest
import torch
from conftest import make_tiny_model, random_prompts

from drafters import DraftModelDrafter, NgramDrafter
from drafters.draft_model import DraftModelConfig
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel


def _drafters(target, draft_lm):
    info = target.target_info()
    return {
        "ngram": NgramDrafter(NgramDrafter.Config(), info),
        "draft_model": DraftModelDrafter(DraftModelConfig(path="tiny"), info, model=draft_lm),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_k0_equals_hf_generate(arch):
    model = make_tiny_model(arch)
    target = TargetModel(model)
    prompt = random_prompts(1, seed=4)[0]
    out = speculative_generate(target, None, [prompt], num_draft_tokens=0, max_new_tokens=24, eos_token_ids=[])
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    assert out.tokens[0] == reference[0, len(prompt):].tolist()
    assert out.target_forwards == 24 and out.verify_forwards == 23


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_speculative_equals_plain_greedy(arch, batch_size):
    target = TargetModel(make_tiny_model(arch))
    prompts = random_prompts(3, seed=1)
    plain = [speculative_generate(target, None, [p], num_draft_tokens=0, max_new_tokens=30).tokens[0] for p in prompts]
    drafters = _drafters(target, make_tiny_model(arch, seed=5, num_layers=1))
    for name, drafter in drafters.items():
        for k in (1, 2, 5):
            for start in range(0, 3, batch_size):
                chunk = prompts[start : start + batch_size]
                out = speculative_generate(target, drafter, chunk, num_draft_tokens=k, max_new_tokens=30)
                assert out.tokens == plain[start : start + batch_size], (name, k)
                assert out.target_forwards == out.verify_forwards + 1


def test_identical_draft_model_accepts_everything():
    model = make_tiny_model("llama")
    target = TargetModel(model)
    drafter = DraftModelDrafter(DraftModelConfig(path="copy"), target.target_info(), model=copy.deepcopy(model))
    out = speculative_generate(target, drafter, random_prompts(3, seed=2), num_draft_tokens=4, max_new_tokens=40,
                               eos_token_ids=[])
    assert all(a == 4 for row in out.accept_lengths for a in row)
    assert all(len(row) == 40 for row in out.tokens)
    assert out.verify_forwards == 8  # 1 token from prefill, then 39 more at 5 per round


def _valid_cache(target):
    """Per row, the key/value tensors of the slots that hold sequence tokens: list over rows of [layers x (K, V)]."""
    rows = []
    for row in range(target.runner.slot_mask.shape[0]):
        keep = target.runner.slot_mask[row].bool()
        rows.append([(layer.keys[row][:, keep], layer.values[row][:, keep]) for layer in target.runner.cache.layers])
    return rows


@pytest.mark.parametrize("batch_size", [1, 3])
def test_kv_rollback_matches_rebuilt_cache(batch_size):
    target = TargetModel(make_tiny_model("llama"))
    prompts = random_prompts(batch_size, seed=3)
    drafter = _drafters(target, make_tiny_model("llama", seed=9, num_layers=1))["draft_model"]
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=3, max_new_tokens=25, eos_token_ids=[])
    assert any(a < 3 for row in out.accept_lengths for a in row), "the test needs rejections"
    if batch_size == 1:  # one row never has holes: rejection is a plain crop
        assert bool(target.runner.slot_mask.all())
    after_run = _valid_cache(target)
    for row, prompt in enumerate(prompts):
        # The cache holds every token but the last emitted one, which the next round would feed.
        sequence = prompt + out.tokens[row][:-1]
        rebuilt = TargetModel(target.model)
        rebuilt.prefill(torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.long))
        for (k_run, v_run), (k_ref, v_ref) in zip(after_run[row], _valid_cache(rebuilt)[0]):
            assert k_run.shape == k_ref.shape
            assert torch.allclose(k_run, k_ref, atol=1e-10) and torch.allclose(v_run, v_ref, atol=1e-10)


def test_hidden_capture_follows_vllm_layer_ids():
    model = make_tiny_model("llama", num_layers=3)
    target = TargetModel(model)
    ids = torch.tensor([random_prompts(1, seed=6)[0]])
    mask = torch.ones_like(ids)
    features = target.features(ids, mask, layer_ids=(0, 1, 2, 3))
    reference = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer_id in (0, 1, 2):
        assert torch.allclose(features.hidden[layer_id], reference[layer_id])
    assert torch.allclose(model.model.norm(features.hidden[3]), features.final_hidden)
    assert torch.allclose(features.final_hidden, reference[-1])
    with pytest.raises(ValueError, match="out of range"):
        target.features(ids, mask, layer_ids=(4,))


def test_whole_loop_sampling_chi_square():
    """T = 1 with a sampling draft model: the joint law of the first three tokens equals the target's."""
    vocab, rows = 6, 6000
    target_lm = _tiny_vocab_model(vocab, seed=0)
    target = TargetModel(target_lm)
    drafter = DraftModelDrafter(DraftModelConfig(path="tiny", sample_drafts=True), target.target_info(),
                                model=_tiny_vocab_model(vocab, seed=1))
    torch.manual_seed(0)
    prompt = [1, 4, 2]
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=2, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[])
    counts = torch.zeros(vocab ** 3)
    for tokens in out.tokens:
        counts[tokens[0] * vocab * vocab + tokens[1] * vocab + tokens[2]] += 1
    expected = _exact_joint(target_lm, prompt, vocab) * rows
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum() + (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(
        expected[~keep].sum(), 1e-9)
    dof = int(keep.sum())  # cells kept + the pooled cell - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (float(chi2), dof)  # about 4 sigma of the chi-square law


def _tiny_vocab_model(vocab, seed):
    model = make_tiny_model("llama", seed=seed)
    model.resize_token_embeddings(vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)  # a soft distribution so that sampling matters
    model.config.eos_token_id = None
    return model


def _exact_joint(model, prompt, vocab):
    seqs = torch.tensor([[a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        logits = model(input_ids=torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)).logits
    probs = torch.softmax(logits.double(), -1)
    start = len(prompt) - 1
    p1 = probs[:, start, :][0]  # [V]
    p2 = probs[:, start + 1, :].reshape(vocab, vocab, vocab)[:, 0, :]  # [t1, t2]
    p3 = probs[:, start + 2, :].reshape(vocab, vocab, vocab)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def test_engine_serves_the_feature_request():
    """A drafter asking for the final hidden state, top-k logits and the target's KV cache gets, after prefill and
    after each verify, exactly what a cache-free forward over the accepted sequence computes."""
    from drafters.base import Drafter, FeatureRequest, Proposal

    class Probe(Drafter):
        kind = "probe"

        def feature_request(self):
            return FeatureRequest(layer_ids=(1,), final_hidden=True, top_k_logits=3, kv_layers=(0, 1))

        def begin(self, context):
            self.contexts = [context]

        def propose(self, num_tokens):
            return Proposal(tokens=torch.full((1, num_tokens), 7))

        def commit(self, num_accepted, context):
            kv = {i: (k.clone(), v.clone()) for i, (k, v) in context.target_kv.items()}
            self.contexts.append((context, kv, context.target_kv_valid.clone()))

    model = make_tiny_model("llama")
    target = TargetModel(model)
    probe = Probe(None, target.target_info())
    out = speculative_generate(target, probe, [[5, 6, 7, 8]], num_draft_tokens=2, max_new_tokens=6)
    sequence = [5, 6, 7, 8] + out.tokens[0]
    ids = torch.tensor([sequence])
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True, use_cache=True)
    first = probe.contexts[0]
    torch.testing.assert_close(first.final_hidden[0], reference.hidden_states[-1][0, :4])
    torch.testing.assert_close(first.hidden[1][0], reference.hidden_states[1][0, :4])
    values, indices = reference.logits[0, :4].topk(3, dim=-1)
    assert torch.equal(first.top_k[1][0], indices) and torch.allclose(first.top_k[0][0], values.float())
    context, kv, valid = probe.contexts[-1]
    kept = valid[0]
    length = int(kept.sum())
    for layer in (0, 1):
        cached = kv[layer][0][0][:, kept]  # [H_kv, length, d]
        torch.testing.assert_close(cached, reference.past_key_values.layers[layer].keys[0][:, :length])
    block = context.input_ids[0][context.valid[0]].tolist()
    assert sequence[length - len(block): length] == block  # the committed block ends the kept sequence
    with pytest.raises(ValueError, match="kv_layers"):
        target.check_request(FeatureRequest(kv_layers=(2,)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_facades_run_untimed_rounds_with_the_same_tokens(temperature):
    """timed=False (api.py): no phase clock, so every time_* phase is 0, and the same tokens and acceptance."""
    from inference.engine.api import tree_speculative_generate

    target = TargetModel(make_tiny_model("llama"))
    drafter = _drafters(target, make_tiny_model("llama", seed=5, num_layers=1))["draft_model"]
    prompts = random_prompts(2, seed=3)
    for call, options in ((speculative_generate, {"num_draft_tokens": 3}), (tree_speculative_generate,
                                                                             {"tree_budget": 4})):
        runs = [call(target, drafter, prompts, max_new_tokens=12, temperature=temperature, seed=7, timed=timed,
                     **options) for timed in (True, False)]
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths
        assert runs[0].time_verify > 0
        assert runs[1].time_draft == runs[1].time_verify == runs[1].time_prefill == 0.0


@pytest.mark.parametrize("field, value, message", [("temperature", -0.5, "temperature must be >= 0"),
                                                   ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
                                                   ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
                                                   ("top_k", -1, "top_k must be >= 0")])
def test_sampling_settings_are_refused_before_the_prefill(field, value, message):
    from inference.engine.verify import Sampling

    with pytest.raises(ValueError, match=message):
        Sampling(**{field: value})
    target = TargetModel(make_tiny_model("llama"))
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, None, random_prompts(1, seed=1), num_draft_tokens=0, max_new_tokens=4,
                             **{field: value})
