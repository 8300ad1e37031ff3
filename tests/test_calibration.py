"""Sequential Temperature Scaling and the confidence metrics (drafters/calibration.py): STS recovers a known
per-position miscalibration and ECE falls while the ranking is kept; ECE, AUROC and Brier against naive
definitions; too few rounds is refused naming how many are needed. (`draftsmith calibrate` end to end on a trained
debug drafter: tests/test_dspark.py.)"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from drafters.calibration import (
    MIN_ROUNDS_PER_BIN,
    NUM_BINS,
    auroc,
    brier_score,
    calibration_report,
    check_rounds,
    expected_calibration_error,
    fit_sts,
    prefix_probabilities,
)


def synthetic_rounds(scales, num_rounds: int = 6000, seed: int = 0):
    """True per-step acceptance logits u [N, K]; step k accepted with probability sigmoid(u_k); prefix labels; the
    drafter reports z = u * scale_k (scale > 1 overconfident, < 1 underconfident): STS should find T_k = scale_k."""
    gen = torch.Generator().manual_seed(seed)
    true = torch.randn(num_rounds, len(scales), generator=gen, dtype=torch.float64) * 1.5 + 1.0
    accepted = (torch.rand(true.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(true)).long()
    labels = accepted.cumprod(dim=1).bool()
    return true * torch.tensor(scales, dtype=torch.float64), labels


def test_sts_recovers_a_known_miscalibration_and_keeps_the_ranking():
    scales = [2.0, 0.5, 3.0]
    logits, labels = synthetic_rounds(scales)
    valid = torch.ones_like(labels)
    valid[:500, 2] = False  # some rounds proposed only two drafts
    temperatures = fit_sts(logits, labels, valid)
    for fitted, scale in zip(temperatures, scales):
        assert fitted == pytest.approx(scale, rel=0.2), (temperatures, scales)
    report = calibration_report(logits, labels, valid, temperatures)
    assert [entry["rounds"] for entry in report] == [6000, 6000, 5500]
    for entry in report:
        assert entry["ece_after"] < entry["ece_before"] / 3 and entry["ece_after"] < 0.03, entry
        assert entry["brier"] <= entry["brier_before"]
        assert entry["temperature"] in temperatures
    # Position 1 is a monotone map of one logit: the ranking is exactly unchanged. Further on, a_k multiplies maps
    # with different temperatures, which may reorder rounds; it must not lose ranking quality here.
    assert report[0]["auroc"] == report[0]["auroc_before"]
    assert all(entry["auroc"] >= entry["auroc_before"] - 0.005 for entry in report[1:])


def test_a_calibrated_drafter_keeps_temperatures_near_one():
    logits, labels = synthetic_rounds([1.0, 1.0], seed=1)
    assert all(t == pytest.approx(1.0, rel=0.2) for t in fit_sts(logits, labels))


def test_metrics_against_naive_definitions():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 8, (60,), generator=gen).double() / 8  # many ties
    labels = torch.rand(60, generator=gen) < scores
    pairs = [(float(p > n) + 0.5 * float(p == n)) for p, n in itertools.product(scores[labels], scores[~labels])]
    assert auroc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), rel=1e-12)
    assert math.isnan(auroc(scores, torch.ones(60, dtype=torch.bool)))  # one class only
    ece = 0.0
    for b in range(NUM_BINS):
        members = [i for i in range(60) if min(int(scores[i] * NUM_BINS), NUM_BINS - 1) == b]
        if members:
            ece += abs(sum(float(scores[i]) for i in members) - sum(float(labels[i]) for i in members)) / 60
    assert expected_calibration_error(scores, labels) == pytest.approx(ece, rel=1e-12)
    assert brier_score(scores, labels) == pytest.approx(float(((scores - labels.double()) ** 2).mean()))
    torch.testing.assert_close(prefix_probabilities(torch.tensor([[0.0, 2.0]]), [1.0, 2.0]),
                               torch.tensor([[0.5, 0.5 * float(torch.sigmoid(torch.tensor(1.0)))]],
                                            dtype=torch.float64))


def test_too_few_rounds_is_refused_naming_how_many_are_needed():
    needed = MIN_ROUNDS_PER_BIN * NUM_BINS
    check_rounds(torch.ones(needed, 3, dtype=torch.bool))
    short = torch.ones(needed, 3, dtype=torch.bool)
    short[5:, 2] = False
    with pytest.raises(ValueError, match=rf"at least {needed} verification rounds.*\(3, 5\).*--num-prompts"):
        check_rounds(short)
