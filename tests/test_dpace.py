"""D-PACE per-position loss weights (drafters/losses.dpace_weights): the definition on hand-worked blocks, invalid
cells, no gradient, and DFlash / DSpark losses with loss_weighting "dpace" against a cell-by-cell reference."""

from __future__ import annotations

import math

import pytest
import torch
from test_dflash import make_batch as dflash_batch
from test_dflash import make_drafter as dflash_drafter
from test_dflash import tiny_target as dflash_target
from test_dspark import make_batch as dspark_batch
from test_dspark import make_drafter as dspark_drafter
from test_dspark import tiny_target as dspark_target

from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.losses import dpace_weights


def reference_weights(q: list[float], valid: list[bool], alpha: float) -> list[float]:
    """w_j = sum_{m >= j, valid} prod_{i <= m, valid} (alpha + (1 - alpha) q_i), 0 at an invalid cell."""
    out = []
    for j in range(len(q)):
        if not valid[j]:
            out.append(0.0)
            continue
        total = 0.0
        for m in range(j, len(q)):
            if valid[m]:
                total += math.prod(alpha + (1 - alpha) * q[i] for i in range(m + 1) if valid[i])
        out.append(total)
    return out


def test_hand_worked_block():
    # alpha 0.5, q = (0.5, 0): smoothed (0.75, 0.5), C = (0.75, 0.375), w = (1.125, 0.375): exact in binary
    weights = dpace_weights(torch.tensor([[0.5, 0.0]]), torch.tensor([[True, True]]), alpha=0.5)
    assert weights.tolist() == [[1.125, 0.375]]


def test_sure_drafts_weigh_the_remaining_cells_and_alpha_one_ignores_confidence():
    valid = torch.tensor([[True, True, True, False]])
    sure = dpace_weights(torch.ones(1, 4), valid, alpha=0.3)
    assert sure.tolist() == [[3.0, 2.0, 1.0, 0.0]]  # every C = 1: w_j counts the valid cells from j on
    unsure = dpace_weights(torch.rand(1, 4, generator=torch.Generator().manual_seed(0)), valid, alpha=1.0)
    assert unsure.tolist() == [[3.0, 2.0, 1.0, 0.0]]


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.9])
def test_matches_the_definition_with_invalid_cells(alpha):
    gen = torch.Generator().manual_seed(1)
    q = torch.rand(6, 7, generator=gen, dtype=torch.float64)
    valid = torch.rand(6, 7, generator=gen) < 0.7
    weights = dpace_weights(q, valid, alpha)
    for row in range(6):
        ref = reference_weights(q[row].tolist(), valid[row].tolist(), alpha)
        # float64 in, float64 out: a product and a sum of at most 7 terms each
        torch.testing.assert_close(weights[row], torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (weights[~valid] == 0).all() and (weights[valid] >= alpha ** 7).all()


def test_weights_carry_no_gradient_and_alpha_is_checked():
    q = torch.rand(2, 3, requires_grad=True)
    assert not dpace_weights(q, torch.ones(2, 3, dtype=torch.bool)).requires_grad
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(q, torch.ones(2, 3, dtype=torch.bool), alpha=0.0)


def test_dflash_dpace_loss_is_the_confidence_weighted_ce():
    target = dflash_target()
    drafter = dflash_drafter(target, loss_weighting="dpace", dpace_alpha=0.4)
    batch = dflash_batch(target, drafter)
    output = drafter(batch)
    loss, _ = drafter.loss(output, batch)
    ce_of = output.logits.detach()
    rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
    ce = torch.nn.functional.cross_entropy(ce_of.flatten(0, 1),
                                           batch["input_ids"][rows, output.label_position].flatten(),
                                           reduction="none").view(rows.shape)
    total = weight = 0.0
    for n in range(ce.shape[0]):
        valid = output.depth_valid[n].tolist()
        ref = reference_weights(torch.exp(-ce[n]).tolist(), valid, 0.4)
        total += sum(w * float(c) for w, c, v in zip(ref, ce[n], valid) if v)
        weight += sum(ref)
    assert loss.item() == pytest.approx(total / weight, rel=1e-9)
    decay = dflash_drafter(target, loss_weighting="decay", dpace_alpha=0.4)
    assert decay.loss(decay(batch), batch)[0].item() != pytest.approx(loss.item(), rel=1e-6)


def test_dspark_dpace_weights_its_cells_by_ce_confidence():
    target = dspark_target()
    base = dspark_drafter(target)
    dpace = dspark_drafter(target, loss_weighting="dpace")
    batch = dspark_batch(target, base)
    out_base, out_dpace = base(batch), dpace(batch)
    torch.testing.assert_close(out_base.logits, out_dpace.logits, rtol=0, atol=0)  # same weights, same seed
    loss_base, metrics = base.loss(out_base, batch)
    loss_dpace, _ = dpace.loss(out_dpace, batch)
    assert math.isfinite(loss_dpace.item()) and loss_dpace.item() != pytest.approx(loss_base.item(), rel=1e-6)
    assert metrics["positions_0"] > 0


def test_bad_loss_weighting_settings_name_the_field():
    target = dflash_target()
    with pytest.raises(ValueError, match="drafter.dpace_alpha"):
        DFlashDrafter(DFlashConfig(layer_ids=(1, 2, 3), num_layers=1, block_size=4, mask_token_id=255,
                                   dpace_alpha=1.5), target.target_info())
    with pytest.raises(ValueError, match="drafter.dpace_alpha"):
        DSparkDrafter(DSparkConfig(layer_ids=(1, 2, 3), num_layers=1, block_size=4, mask_token_id=255,
                                   markov_rank=8, dpace_alpha=0.0), dspark_target().target_info())
