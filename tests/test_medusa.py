"""Medusa heads (drafters/medusa/): the training forward against a naive reference, the depth mapping (head k reads
the hidden state of the position BEFORE the anchor and predicts the token k + 1 places after the anchor), the
identity start, the heads' lm_head choices and the 0.8^k loss. Proposer agreement, lossless decoding and save/load
are tested for every drafter in test_contract.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model

from drafters.base import DraftContext
from drafters.medusa import MedusaConfig, MedusaDrafter
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider


@pytest.fixture(scope="module")
def target():
    return TargetModel(make_tiny_model("llama", num_layers=2), name_or_path="tiny")


def build(target, **overrides) -> MedusaDrafter:
    torch.manual_seed(0)
    drafter = MedusaDrafter(MedusaConfig(**{"num_heads": 3, **overrides}), target.target_info()).double()
    with torch.no_grad():  # away from the identity start, so that every head computes something of its own
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter


def batch_for(target, drafter, input_ids, loss_mask=None):
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "loss_mask": torch.ones_like(input_ids) if loss_mask is None else loss_mask}
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    return batch


def naive_head(drafter, k: int, hidden: torch.Tensor) -> torch.Tensor:
    """Head k written out: h + SiLU(W h + b) per block, then the head's (or the target's) lm_head."""
    head = drafter.heads[k]
    x = hidden.double()
    for block in head.blocks:
        x = x + F.silu(x @ block.linear.weight.T + block.linear.bias)
    weight = head.lm_head.weight if head.lm_head is not None else drafter.target_info.lm_head_weight
    return x @ weight.T


def test_training_forward_equals_naive_reference(target):
    drafter = build(target, num_layers=2)
    input_ids = torch.randint(3, 250, (2, 9))
    loss_mask = torch.ones_like(input_ids)
    loss_mask[0, :5] = 0
    batch = batch_for(target, drafter, input_ids, loss_mask)
    batch["attention_mask"][1, 7:] = 0
    with torch.no_grad():
        output = drafter(batch)
    lengths, expected_cells = [9, 7], 0
    for n in range(output.logits.shape[0]):
        row, t = int(output.batch_index[n]), int(output.label_position[n, 0]) - 2
        for k in range(3):
            label = t + k + 2  # head k on h_t predicts the token k + 2 places after t
            valid = label < lengths[row] and bool(loss_mask[row, label])
            assert bool(output.depth_valid[n, k]) == valid
            if valid:
                assert int(output.label_position[n, k]) == label
                expected = naive_head(drafter, k, batch["final_hidden"][row, t])
                torch.testing.assert_close(output.logits[n, k], expected, rtol=1e-10, atol=1e-10)
                expected_cells += 1
    assert expected_cells == int(output.depth_valid.sum()) > 0


def test_depth_k_reads_the_hidden_state_before_the_anchor_and_predicts_k_plus_one_after_it(target):
    """At inference the anchor is the token the target just emitted (no hidden state yet): head k runs on the final
    hidden state of the last prompt position and its draft is the (k+1)-th token after the anchor, which the training
    forward labels anchor + 1 + k from the row t = anchor - 1."""
    drafter = build(target)
    prompt = torch.tensor([[5, 17, 33, 9, 120, 41]])
    _, served = target.prefill(prompt, torch.ones_like(prompt), drafter.feature_request())
    anchor_token = 77
    drafter.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(6)[None],
                               next_tokens=torch.tensor([anchor_token]), **served.context()))
    proposal = drafter.propose(3)
    last_hidden = served.final_hidden[0, -1]  # position 5, the one before the anchor (position 6)
    for k in range(3):
        assert int(proposal.tokens[0, k]) == int(naive_head(drafter, k, last_hidden).argmax())
    sequence = torch.cat([prompt, torch.tensor([[anchor_token]]), proposal.tokens], dim=1)  # drafts as ground truth
    batch = batch_for(target, drafter, sequence)
    with torch.no_grad():
        output = drafter(batch)
    row = int(((output.batch_index == 0) & (output.label_position[:, 0] == 6 + 1)).nonzero())
    assert output.label_position[row].tolist() == [7, 8, 9]  # anchor 6: depth k labels 6 + 1 + k
    assert output.logits[row].argmax(-1).tolist() == proposal.tokens[0].tolist()


def test_fresh_blocks_are_the_identity_and_heads_follow_the_lm_head_choice(target):
    info = target.target_info()
    hidden = torch.randn(4, 64, dtype=torch.float64)
    shared = MedusaDrafter(MedusaConfig(num_heads=2), info).double()
    assert not any("lm_head" in name for name, _ in shared.named_parameters())  # the target's head, frozen
    for k in range(2):  # zero-initialised blocks: every head starts as the target's own next-token head
        torch.testing.assert_close(shared.head_logits(hidden)[:, k], hidden @ info.lm_head_weight.T)
    copied = MedusaDrafter(MedusaConfig(num_heads=2, lm_head="copy"), info).double()
    assert all(torch.equal(head.lm_head.weight, info.lm_head_weight) for head in copied.heads)
    assert all(head.lm_head.weight.requires_grad for head in copied.heads)
    new = MedusaDrafter(MedusaConfig(num_heads=2, lm_head="new"), info).double()
    assert not torch.equal(new.heads[0].lm_head.weight, info.lm_head_weight)


@pytest.mark.parametrize("loss_kind", ["soft", "hard"])
def test_loss_weights_heads_by_point_eight_to_the_k(target, loss_kind):
    drafter = build(target, loss=loss_kind)
    input_ids = torch.randint(3, 250, (2, 10))
    batch = batch_for(target, drafter, input_ids)
    with torch.no_grad():
        target_logits = target.model(input_ids=input_ids).logits
    output = drafter(batch)
    loss, metrics = drafter.loss(output, batch)
    expected = 0.0
    for k in range(3):
        valid = output.depth_valid[:, k]
        rows, labels = output.batch_index[valid], output.label_position[valid, k]
        log_q = torch.log_softmax(output.logits[valid, k], dim=-1)
        if loss_kind == "soft":
            cells = -(torch.softmax(target_logits[rows, labels - 1], dim=-1) * log_q).sum(-1)
        else:
            cells = -log_q.gather(1, input_ids[rows, labels][:, None])[:, 0]
        expected = expected + 0.8**k * cells.mean()
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    assert {"acc_0", "acc_2", "sim_accept_length"} <= set(metrics)


def test_bad_config_and_proposal_length_name_the_field(target):
    with pytest.raises(ValueError, match="drafter.num_heads"):
        MedusaDrafter(MedusaConfig(num_heads=0), target.target_info())
    drafter = build(target)
    assert drafter.max_draft_tokens() == 3
    with pytest.raises(ValueError, match="propose\\(\\) called before begin"):
        drafter.propose(2)
