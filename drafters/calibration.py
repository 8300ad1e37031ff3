"""Sequential Temperature Scaling (STS) and the confidence metrics of any drafter whose proposals carry confidence
logits (DSpark's confidence head; DSpark paper section 3.2.1, reference algorithms_dflash_dspark.md 2.2; DeepSpec
released neither). `draftsmith calibrate` (inference/evaluation/calibrate.py) fits and reports with it.

Data: for N verification rounds, the confidence logits z [N, K] of the drafts (computed before each draft was drawn)
and the prefix-acceptance labels y [N, K], y_{n,k} = 1 when the first k + 1 drafts of round n were all accepted;
`valid` [N, K] marks the positions a round proposed. The calibrated prefix survival at position k is
a_k = prod_{i<=k} sigmoid(z_i / T_i).

STS fits T_1..T_K in order: T_k minimises the expected calibration error of a_k against y_k over a log-spaced grid,
with T_1..T_{k-1} frozen. At position 1 this is a monotone map of z, so the ranking (AUROC) is exactly unchanged;
further on, a_k multiplies per-position maps with different temperatures, which can reorder two rounds whose
logits trade places between positions, so AUROC there moves slightly (both are reported).

ECE: 20 equal-width bins, sum_b |mean(a) - mean(y)| * count_b / N (DeepSpec's evaluation uses the same 20 bins).
AUROC: the Mann-Whitney statistic with ties counted half. Brier: mean (a - y)^2.

A fit needs enough rounds to fill the bins: MIN_ROUNDS_PER_BIN x num_bins rounds at every position (`check_rounds`
raises naming how many are needed).
"""

from __future__ import annotations

import math

import torch

NUM_BINS = 20
MIN_ROUNDS_PER_BIN = 10
TEMPERATURE_GRID = tuple(torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64).tolist())


def prefix_probabilities(logits: torch.Tensor, temperatures) -> torch.Tensor:
    """a [N, K] = cumprod(sigmoid(z / T)) for logits [N, K] and K temperatures (float64)."""
    scale = torch.as_tensor(list(temperatures), dtype=torch.float64)
    return torch.sigmoid(logits.double() / scale).cumprod(dim=-1)


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """Equal-width-bin ECE of probs [M] against binary labels [M] (nan when M = 0)."""
    probs, labels = probs.double().flatten(), labels.double().flatten()
    if probs.numel() == 0:
        return float("nan")
    bins = (probs * num_bins).long().clamp(0, num_bins - 1)
    count = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, torch.ones_like(probs))
    gap = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, probs - labels)
    return float(gap.abs().sum() / probs.numel())


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative) + half the ties; nan when a class is absent."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = torch.argsort(scores)
    _, inverse, counts = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts + 1
    ranks = torch.empty_like(scores)
    ranks[order] = (first + (counts - 1) / 2.0).double()[inverse]  # 1-based ranks, ties share their mean
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    probs, labels = probs.double().flatten(), labels.double().flatten()
    return float(((probs - labels) ** 2).mean()) if probs.numel() else float("nan")


def check_rounds(valid: torch.Tensor, num_bins: int = NUM_BINS, min_per_bin: int = MIN_ROUNDS_PER_BIN) -> None:
    """Raise ValueError unless every position has at least min_per_bin x num_bins rounds."""
    needed = min_per_bin * num_bins
    counts = valid.sum(dim=0).tolist() if valid.numel() else [0]
    short = [(k + 1, int(c)) for k, c in enumerate(counts) if c < needed]
    if short:
        raise ValueError(f"STS needs at least {needed} verification rounds per draft position ({min_per_bin} per ECE "
                         f"bin x {num_bins} bins); positions (position, rounds) {short} have fewer: raise "
                         "--num-prompts or --max-new-tokens")


def fit_sts(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None = None,
            grid=TEMPERATURE_GRID, num_bins: int = NUM_BINS) -> list[float]:
    """Sequential Temperature Scaling: one temperature per position, fitted in order with the earlier ones frozen.

    Args:
        logits, labels: [N, K]; valid: [N, K] bool (default all). Rows of a position must be valid at the earlier
            positions too (a round proposes a prefix).
    Returns:
        K temperatures (ties between grid points go to the one nearest 1).
    """
    logits, labels = logits.double(), labels.double()
    valid = torch.ones_like(labels, dtype=torch.bool) if valid is None else valid.bool()
    grid_t = torch.tensor(list(grid), dtype=torch.float64)
    preference = grid_t.log().abs()
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)
    temperatures = []
    for k in range(logits.shape[1]):
        rows = valid[:, k]
        candidates = prefix[rows, None] * torch.sigmoid(logits[rows, k, None] / grid_t)  # [M, G]
        errors = torch.tensor([expected_calibration_error(candidates[:, g], labels[rows, k], num_bins)
                               for g in range(len(grid_t))])
        if rows.any():
            best = errors.min()
            tied = (errors <= best + 1e-12).nonzero().flatten()
            choice = int(tied[preference[tied].argmin()])
        else:
            choice = int(preference.argmin())
        temperatures.append(float(grid_t[choice]))
        prefix = prefix * torch.sigmoid(logits[:, k] / grid_t[choice])
    return temperatures


def reliability(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = NUM_BINS) -> list[dict]:
    """Per non-empty bin: its range, mean predicted survival, observed rate, count (the reliability diagram)."""
    probs, labels = probs.double().flatten(), labels.double().flatten()
    bins = (probs * num_bins).long().clamp(0, num_bins - 1)
    out = []
    for b in range(num_bins):
        members = bins == b
        if members.any():
            out.append({"range": [b / num_bins, (b + 1) / num_bins], "predicted": float(probs[members].mean()),
                        "observed": float(labels[members].mean()), "count": int(members.sum())})
    return out


def calibration_report(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                       temperatures, num_bins: int = NUM_BINS) -> list[dict]:
    """Per position (1-based): rounds, temperature, ece_before / ece_after, auroc (after) / auroc_before, brier
    (after) / brier_before, observed survival, and the reliability bins before and after."""
    before = prefix_probabilities(logits, [1.0] * logits.shape[1])
    after = prefix_probabilities(logits, temperatures)
    report = []
    for k in range(logits.shape[1]):
        rows = valid[:, k].bool()
        y = labels[rows, k]
        report.append({
            "position": k + 1, "rounds": int(rows.sum()), "temperature": float(temperatures[k]),
            "ece_before": expected_calibration_error(before[rows, k], y, num_bins),
            "ece_after": expected_calibration_error(after[rows, k], y, num_bins),
            "auroc": auroc(after[rows, k], y), "auroc_before": auroc(before[rows, k], y),
            "brier": brier_score(after[rows, k], y), "brier_before": brier_score(before[rows, k], y),
            "observed_survival": float(y.double().mean()) if rows.any() else float("nan"),
            "reliability_before": reliability(before[rows, k], y, num_bins),
            "reliability_after": reliability(after[rows, k], y, num_bins),
        })
    return report
