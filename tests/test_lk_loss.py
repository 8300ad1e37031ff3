"""Acceptance-direct losses (drafters/losses.py): the LK losses (-log of the expected acceptance, and the hybrid with
KL) against hand computations and autograd references, for EAGLE-3, MTP and Medusa cell by cell; Spec-AUF's support
truncation for DFlash and DSpark against a first-failure loop written out here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model
from test_dflash import make_batch as dflash_batch
from test_dflash import make_drafter as dflash_drafter
from test_dflash import tiny_target as dflash_target
from test_dspark import make_batch as dspark_batch
from test_dspark import make_drafter as dspark_drafter
from test_dspark import tiny_target as dspark_target
from test_eagle3 import make_batch as eagle3_batch
from test_eagle3 import make_drafter as eagle3_drafter
from test_eagle3 import tiny_target as eagle3_target

from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.losses import auf_support, expected_acceptance, lk_cell_loss
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.mtp import MTPConfig, MTPDrafter
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider

F64 = torch.float64


# ---- the definitions on a hand-worked position ----------------------------------------------------------------------
# q = softmax(0, 0, ln 2) = (1/4, 1/4, 1/2) against p = (1/2, 3/10, 1/5): alpha = 1/4 + 1/4 + 1/5 = 7/10. The draft is
# below the target on the first two tokens (g = 1, 1, 0), <q, g> = 1/2, so d alpha / dz = q (g - 1/2)
# = (1/8, 1/8, -1/4).
Z = [0.0, 0.0, math.log(2.0)]
P = [0.5, 0.3, 0.2]
Q = [0.25, 0.25, 0.5]
D_ALPHA = [0.125, 0.125, -0.25]


def hand_position():
    return torch.tensor([Z], dtype=F64, requires_grad=True), torch.tensor([P], dtype=F64)


def test_expected_acceptance_and_its_gradient_by_hand():
    logits, teacher = hand_position()
    alpha = expected_acceptance(logits, teacher)
    alpha.sum().backward()
    # float64 softmax of exactly representable logits: a few ulps
    torch.testing.assert_close(alpha, torch.tensor([0.7], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(logits.grad, torch.tensor([D_ALPHA], dtype=F64), rtol=0, atol=1e-15)


def test_lk_is_minus_log_acceptance_with_gradient_over_alpha():
    logits, teacher = hand_position()
    loss, alpha = lk_cell_loss(logits, teacher, "lk")
    loss.sum().backward()
    assert not alpha.requires_grad
    torch.testing.assert_close(loss, torch.tensor([-math.log(0.7)], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(logits.grad, torch.tensor([[-d / 0.7 for d in D_ALPHA]], dtype=F64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("eta", [0.0, 3.0, 50.0])
def test_hybrid_is_adaptive_kl_plus_total_variation_by_hand(eta):
    logits, teacher = hand_position()
    loss, _ = lk_cell_loss(logits, teacher, "lk_hybrid", eta)
    loss.sum().backward()
    lam = math.exp(-eta * 0.7)  # detached: the weight itself gets no gradient
    kl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    assert float(loss.detach()) == pytest.approx(lam * kl + (1 - lam) * 0.3, rel=1e-14)
    # d KL / dz = q - p; d (1 - alpha) / dz = -d alpha / dz
    grad = [lam * (q - p) - (1 - lam) * d for p, q, d in zip(P, Q, D_ALPHA)]
    torch.testing.assert_close(logits.grad, torch.tensor([grad], dtype=F64), rtol=0, atol=1e-14)


def test_gradients_equal_autograd_through_the_plain_formulas():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 40, generator=gen, dtype=F64, requires_grad=True)
    teacher = torch.softmax(torch.randn(5, 40, generator=gen, dtype=F64) * 2, dim=-1)  # shared by the 3 depths
    loss, alpha = lk_cell_loss(logits, teacher, "lk_hybrid", 3.0)
    (loss * torch.arange(1.0, 4.0, dtype=F64)).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    q, p = torch.softmax(logits, dim=-1), teacher.unsqueeze(1).expand_as(logits)
    plain_alpha = torch.minimum(q, p).sum(-1)
    lam = torch.exp(-3.0 * plain_alpha.detach())
    plain = lam * (p * (p.log() - q.log())).sum(-1) + (1 - lam) * (1 - plain_alpha)
    (plain * torch.arange(1.0, 4.0, dtype=F64)).sum().backward()
    torch.testing.assert_close(loss, plain, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(alpha, plain_alpha.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours, logits.grad, rtol=1e-10, atol=1e-14)


def test_a_point_mass_teacher_makes_lk_the_cross_entropy():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1), dtype=F64)
    labels = torch.tensor([0, 3, 8, 5])
    loss, _ = lk_cell_loss(logits, F.one_hot(labels, 9).to(F64), "lk")
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, reduction="none"), rtol=1e-12, atol=1e-14)


# ---- each kind: its LK loss equals a cell-by-cell reference ------------------------------------------------------
def test_eagle3_lk_is_the_decayed_per_depth_mean_of_minus_log_acceptance_on_the_draft_vocabulary():
    target = eagle3_target()
    drafter = eagle3_drafter(target, loss="lk")
    batch = eagle3_batch(target, drafter)
    output = drafter(batch)
    loss, metrics = drafter.loss(output, batch)
    draft_ids = drafter.draft_ids()
    head = target.target_info().lm_head_weight[draft_ids]
    total, alphas = 0.0, []
    for depth in range(3):
        valid = output.depth_valid[:, depth]
        rows, positions = output.batch_index[valid], output.label_position[valid, depth] - 1
        # the target's distribution renormalised on the draft vocabulary: its mass outside is left out
        teacher = torch.softmax(batch["final_hidden"][rows, positions] @ head.T, dim=-1)
        alpha = torch.minimum(torch.softmax(output.logits[valid, depth], dim=-1), teacher).sum(-1)
        alphas.append(alpha)
        total = total + 0.8**depth * (-alpha.log()).mean()
        assert float(metrics[f"loss_{depth}"]) == pytest.approx(float((-alpha.log()).mean().detach()), rel=1e-10)
    torch.testing.assert_close(loss, total, rtol=1e-10, atol=1e-12)
    assert float(metrics["expected_accept"]) == pytest.approx(float(torch.cat(alphas).mean().detach()), rel=1e-10)
    loss.backward()
    assert drafter.lm_head.weight.grad is not None and torch.isfinite(drafter.fc.weight.grad).all()


def _features(target, drafter, input_ids):
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "loss_mask": torch.ones_like(input_ids)}
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    return batch


@pytest.mark.parametrize("kind", ["mtp", "medusa"])
@pytest.mark.parametrize("loss_kind", ["lk", "lk_hybrid"])
def test_full_vocabulary_kinds_weigh_the_lk_cells_as_their_cross_entropy(kind, loss_kind):
    target = TargetModel(make_tiny_model("llama", num_layers=2), name_or_path="tiny")
    torch.manual_seed(0)
    if kind == "mtp":
        drafter = MTPDrafter(MTPConfig(num_modules=3, loss=loss_kind, lk_eta=2.0, loss_weights=(0.5, 0.3, 0.2)),
                             target.target_info()).double()
        weights = (0.5, 0.3, 0.2)
    else:
        drafter = MedusaDrafter(MedusaConfig(num_heads=3, loss=loss_kind, lk_eta=2.0), target.target_info()).double()
        weights = (1.0, 0.8, 0.64)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    input_ids = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(4))
    batch = _features(target, drafter, input_ids)
    with torch.no_grad():
        target_logits = target.model(input_ids=input_ids).logits
    output = drafter(batch)
    loss, metrics = drafter.loss(output, batch)
    expected = 0.0
    for depth, weight in enumerate(weights):
        valid = output.depth_valid[:, depth]
        rows, labels = output.batch_index[valid], output.label_position[valid, depth]
        p = torch.softmax(target_logits[rows, labels - 1], dim=-1)
        q = torch.softmax(output.logits[valid, depth], dim=-1)
        alpha = torch.minimum(p, q).sum(-1)
        if loss_kind == "lk":
            cells = -alpha.log()
        else:
            lam = torch.exp(-2.0 * alpha)
            cells = lam * (p * (p.log() - q.log())).sum(-1) + (1 - lam) * (1 - alpha)
        expected = expected + weight * cells.mean()
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    assert 0 < float(metrics["expected_accept"]) < 1
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)


def test_bad_lk_eta_names_the_field():
    info = eagle3_target().target_info()
    with pytest.raises(ValueError, match="drafter.lk_eta"):
        Eagle3Drafter(Eagle3Config(draft_vocab_size=64, lk_eta=-1.0), info)
    with pytest.raises(ValueError, match="drafter.lk_eta"):
        MTPDrafter(MTPConfig(loss="lk_hybrid", lk_eta=-0.5), info)
    with pytest.raises(ValueError, match="drafter.lk_eta"):
        MedusaDrafter(MedusaConfig(lk_eta=float("nan")), info)


# ---- Spec-AUF: the support ends at each block's first predicted failure ------------------------------------------
def reference_support(correct: list[bool], valid: list[bool]) -> list[bool]:
    out, failed = [], False
    for right, ok in zip(correct, valid):
        out.append(ok and not failed)
        failed = failed or (ok and not right)
    return out


def test_auf_support_by_hand_and_against_the_loop():
    correct = torch.tensor([[True, True, False, True, False], [True, False, False, True, True]])
    valid = torch.tensor([[True, True, True, True, True], [True, False, True, True, True]])
    # row 0 fails first at slot 2: slots 0..2 kept. Row 1: slot 1 is not supervised (no failure there), slot 2 fails.
    assert auf_support(correct, valid).tolist() == [[True, True, True, False, False],
                                                    [True, False, True, False, False]]
    gen = torch.Generator().manual_seed(5)
    correct, valid = torch.rand(40, 7, generator=gen) < 0.7, torch.rand(40, 7, generator=gen) < 0.8
    ours = auf_support(correct, valid)
    for row in range(40):
        assert ours[row].tolist() == reference_support(correct[row].tolist(), valid[row].tolist())


def _with_right_drafts(batch, output):
    """A loss batch whose labels are the draft's own argmax at the first two cells of every block, so that supports
    run past the first slot (the logits, already computed, do not change)."""
    ids = batch["input_ids"].clone()
    predicted = output.target_ids(output.logits.detach().argmax(dim=-1))
    for n in range(output.num_rows):
        for k in range(2):
            if output.depth_valid[n, k]:
                ids[output.batch_index[n], output.label_position[n, k]] = predicted[n, k]
    return dict(batch, input_ids=ids)


def test_dflash_auf_is_the_decayed_ce_over_each_blocks_cells_until_its_first_failure():
    target = dflash_target()
    drafter = dflash_drafter(target, loss_weighting="auf", loss_decay_gamma=2.0)
    batch = dflash_batch(target, drafter)
    output = drafter(batch)
    batch = _with_right_drafts(batch, output)
    loss, _ = drafter.loss(output, batch)
    rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
    labels = batch["input_ids"][rows, output.label_position]
    logits = output.logits.detach()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    correct = logits.argmax(-1) == labels
    total = weight = 0.0
    lengths = []
    for n in range(ce.shape[0]):
        support = reference_support(correct[n].tolist(), output.depth_valid[n].tolist())
        lengths.append(sum(support))
        for k, kept in enumerate(support):
            if kept:
                total += math.exp(-k / 2.0) * float(ce[n, k])
                weight += math.exp(-k / 2.0)
    assert loss.item() == pytest.approx(total / weight, rel=1e-12)
    assert max(lengths) >= 2 and sum(lengths) < int(output.depth_valid.sum())  # supports grew, and some were cut


def test_dspark_auf_equals_its_decay_loss_on_the_truncated_cells():
    target = dspark_target()
    auf = dspark_drafter(target, loss_weighting="auf")
    batch = dspark_batch(target, auf)
    output = auf(batch)
    batch = _with_right_drafts(batch, output)
    loss, _ = auf.loss(output, batch)
    rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
    correct = output.logits.detach().argmax(-1) == batch["input_ids"][rows, output.label_position]
    support = auf_support(correct, output.depth_valid)
    assert bool((support != output.depth_valid).any()) and int(support.sum(1).max()) >= 2
    decay = dspark_drafter(target, loss_weighting="decay")
    truncated = dataclasses.replace(output, logits=output.logits, depth_valid=support)
    reference, _ = decay.loss(truncated, batch)
    # the same cells and weights; AUF also sums zero-weight cells, which can only move the last bits of the sum
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
