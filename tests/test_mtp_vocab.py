"""MTP heads over a draft vocabulary (drafters/mtp/, MTPConfig.draft_vocab_size): the trained head over the V_d most
frequent tokens with EAGLE-3's d2t / t2d (drafters/vocab.py). Its logits are the target head's rows at the warm start,
its losses are computed on the renormalised teacher, its proposals are target ids and agree with the training forward,
the engine stays lossless (greedy equals plain greedy; the target's law at temperature 1), the native format carries
it and every other layout refuses it naming its reader."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import joint_counts
from test_contract import NUM_DRAFTS, decode_with_forced_accepts, exact_joint, tiny_target, training_batch

from drafters import load_drafter
from drafters.base import DraftContext
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.vocab import DraftVocab
from inference.engine.api import speculative_generate


def counts_for(vocab_size: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 50, (vocab_size,), generator=torch.Generator().manual_seed(seed))


def make(target, draft_vocab_size: int | None, seed: int = 0, perturb: bool = True, **config) -> MTPDrafter:
    """An MTP-3 drafter whose vocabulary (when reduced) is picked from seeded random counts."""
    info = target.target_info()
    torch.manual_seed(seed)
    drafter = MTPDrafter(MTPConfig(num_modules=NUM_DRAFTS, draft_vocab_size=draft_vocab_size, **config), info)
    drafter.init_from_data(counts_for(info.vocab_size))
    drafter = drafter.to(info.embed_weight.dtype)
    if perturb:  # the modules start near the identity: move every parameter so that nothing is trivial
        with torch.no_grad():
            for parameter in drafter.parameters():
                parameter.add_(0.02 * torch.randn_like(parameter))
    return drafter.eval()


SEQUENCES = [[5, 9, 31, 77, 8, 120, 64, 3, 200, 41, 17, 99], [250, 11, 64, 90, 3, 45, 6, 230]]


def test_the_warm_started_head_is_the_targets_rows_and_untrainable_cells_drop_out():
    target = tiny_target()
    full, reduced = make(target, None, perturb=False), make(target, 160, perturb=False)
    vocab = DraftVocab.from_counts(counts_for(256), 160)
    assert torch.equal(reduced.draft_ids(), vocab.draft_ids) and torch.equal(reduced.t2d, vocab.t2d)
    batch = training_batch(target, full, SEQUENCES)
    with torch.no_grad():
        out_full, out_reduced = full(batch), reduced(batch)
    assert torch.equal(out_reduced.draft_ids, vocab.draft_ids) and out_full.draft_ids is None
    # the same modules (their seeded init is drawn before the head exists), and the head is the target's rows
    torch.testing.assert_close(out_reduced.logits, out_full.logits[..., vocab.draft_ids], rtol=1e-12, atol=1e-12)
    rows = out_full.batch_index.unsqueeze(1).expand_as(out_full.label_position)
    in_vocab = vocab.t2d[batch["target_argmax"][rows, out_full.label_position - 1]]
    assert torch.equal(out_reduced.depth_valid, out_full.depth_valid & in_vocab)
    assert bool((out_full.depth_valid & ~in_vocab).any())  # some cells are dropped: the test sees the mask


@pytest.mark.parametrize("loss_kind", ["soft", "hard", "lk"])
def test_losses_run_on_the_renormalised_teacher_and_draft_indices(loss_kind):
    target = tiny_target()
    drafter = make(target, 160, loss=loss_kind).train()
    batch = training_batch(target, drafter, SEQUENCES)
    output = drafter(batch)
    loss, metrics = drafter.loss(output, batch)
    ids, head = drafter.draft_ids(), target.target_info().lm_head_weight
    expected = 0.0
    for depth in range(NUM_DRAFTS):
        valid = output.depth_valid[:, depth]
        rows, labels = output.batch_index[valid], output.label_position[valid, depth]
        logits = output.logits[valid, depth]
        teacher = torch.softmax(batch["final_hidden"][rows, labels - 1].to(head.dtype) @ head[ids].T, dim=-1)
        if loss_kind == "soft":
            cells = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1)
        elif loss_kind == "hard":
            index = (batch["input_ids"][rows, labels].unsqueeze(1) == ids).long().argmax(dim=1)  # its draft index
            cells = F.cross_entropy(logits, index, reduction="none")
        else:
            cells = -torch.minimum(torch.softmax(logits, dim=-1), teacher).sum(-1).log()
        expected = expected + cells.mean() / NUM_DRAFTS
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)  # float64 sums in another order
    loss.backward()
    assert drafter.lm_head.weight.grad is not None and float(drafter.lm_head.weight.grad.abs().sum()) > 0
    assert target.target_info().lm_head_weight.grad is None
    assert {"acc_0", "data_acc", "sim_accept_length"} <= set(metrics)


def test_proposals_are_target_ids_and_equal_the_training_forward():
    target = tiny_target()
    drafter = make(target, 160)
    prompts = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90, 3]]
    with torch.no_grad():
        sequences, rounds = decode_with_forced_accepts(target, drafter, prompts,
                                                       [[2, NUM_DRAFTS, 0, 1], [0, 1, NUM_DRAFTS, None]])
        output = drafter(training_batch(target, drafter, sequences))
    cells = {}
    for n in range(output.logits.shape[0]):
        for k in range(NUM_DRAFTS):
            cells[(int(output.batch_index[n]), int(output.label_position[n, k]) - 1 - k, k)] = output.logits[n, k]
    checked = 0
    for row, row_rounds in enumerate(rounds):
        for anchor, proposed, accepted in row_rounds:
            assert all(bool(drafter.t2d[token]) for token in proposed)  # target ids inside the draft vocabulary
            for k in range(min(accepted + 1, NUM_DRAFTS)):
                assert int(output.target_ids(cells[(row, anchor, k)].argmax())) == proposed[k], (row, anchor, k)
                checked += 1
    assert checked >= 12


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]])
def test_greedy_output_equals_plain_greedy(prompts):
    target = tiny_target()
    drafter = make(target, 96)  # a small vocabulary: many of the target's tokens can never be drafted
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=20)
    spec = speculative_generate(target, drafter, prompts, num_draft_tokens=NUM_DRAFTS, max_new_tokens=20)
    assert spec.tokens == plain.tokens
    emitted = {token for row in plain.tokens for token in row}
    assert emitted - set(drafter.draft_ids().tolist()), "the test needs target tokens outside the draft vocabulary"


def test_sampling_law_is_the_targets():
    """T = 1, a 6-token target and a 4-token draft vocabulary: q is zero on the 2 tokens outside it, and rejection
    sampling still emits exactly the target's law (chi-square, about 4 sigma)."""
    vocab, rows = 6, 4000
    target = tiny_target(vocab_size=vocab)
    drafter = make(target, 4, sample_drafts=True, num_steps=None)
    prompt = [1, 4, 2, 5, 3]
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=2, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[])
    counts = joint_counts(out.tokens, vocab)
    expected = exact_joint(target.model, prompt, vocab) * rows
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum()
    chi2 += (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(float(expected[~keep].sum()), 1e-9)
    dof = int(keep.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (float(chi2), dof)
    assert sum(map(sum, out.accept_lengths)) > 0


def test_native_format_carries_the_vocabulary_and_other_layouts_refuse_it_naming_their_reader(tmp_path):
    target = tiny_target(dtype=torch.float32)
    drafter = make(target, 160)
    drafter.save(str(tmp_path / "native"))
    with open(tmp_path / "native" / "config.json") as f:
        assert json.load(f)["drafter_config"]["draft_vocab_size"] == 160
    loaded = load_drafter(str(tmp_path / "native"), target.target_info()).eval()
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    prompt = torch.tensor([[5, 17, 33, 9, 120, 41, 7, 5, 17]])
    proposals = []
    for candidate in (drafter, loaded):
        _, served = target.prefill(prompt, torch.ones_like(prompt), candidate.feature_request())
        candidate.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool),
                                     torch.arange(prompt.shape[1])[None], next_tokens=torch.tensor([33]),
                                     **served.context()))
        proposals.append(candidate.propose(NUM_DRAFTS).tokens)
    assert torch.equal(proposals[0], proposals[1])
    for fmt, reader in (("speculators", "vLLM's speculators mtp reader"), ("deepseek_v3", "DeepSeek-V3 MTP loader")):
        with pytest.raises(ValueError, match=f"--format {fmt}: .*{reader}.*draft_vocab_size 160") as err:
            drafter.save(str(tmp_path / fmt), fmt)
        assert "\n" not in str(err.value) and not os.path.exists(tmp_path / fmt / "model.safetensors")


def test_a_draft_vocabulary_outside_the_target_names_the_field():
    info = tiny_target().target_info()
    for size in (0, info.vocab_size + 1):
        with pytest.raises(ValueError, match="drafter.draft_vocab_size"):
            MTPDrafter(MTPConfig(draft_vocab_size=size), info)
