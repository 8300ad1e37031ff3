"""tau from counts (`accept_length_mean`) and over questions: each question's (rounds, accepted), tau's bootstrap
interval with questions as the unit, and the paired interval of two drafters' difference over the same questions
(inference/evaluation/metrics.py keeps them in each record as tau_ci95 and tau_per_question; report.py prints the
paired table).
"""

from __future__ import annotations

import torch

from inference.engine.generate import GenerateOutput


def accept_length_mean(rounds: int, accepted: int) -> float | None:
    """tau = 1 + accepted / rounds: tokens a row gains per verify forward, the bonus token included (docs/
    ARCHITECTURE.md, Conventions). The one place tau is computed from counts (reports, the training probe, doctor)."""
    return None if rounds == 0 else 1.0 + accepted / rounds


TAU_RESAMPLES = 2000  # bootstrap resamples of the questions for tau's interval (seeded: the same report each run)


def question_counts(out: GenerateOutput, rows: list) -> dict:
    """{question: [rounds, accepted]} of one engine call whose row r answered question rows[r] (several calls and
    turns of one question add up: `merge_counts`)."""
    counts: dict = {}
    for question, lengths in zip(rows, out.accept_lengths):
        entry = counts.setdefault(question, [0, 0])
        entry[0] += len(lengths)
        entry[1] += sum(lengths)
    return counts


def merge_counts(parts) -> dict:
    """{question: [rounds, accepted]} summed over several `question_counts`."""
    merged: dict = {}
    for part in parts:
        for question, (rounds, accepted) in part.items():
            entry = merged.setdefault(question, [0, 0])
            entry[0] += rounds
            entry[1] += accepted
    return merged


def _resampled_taus(per_question: list, picks: torch.Tensor) -> torch.Tensor:
    """[R] tau = 1 + accepted / rounds pooled over each resample's questions (picks [R, Q] indexes per_question)."""
    table = torch.tensor(per_question, dtype=torch.float64)  # [Q, 2]: rounds, accepted
    return 1.0 + table[picks, 1].sum(-1) / table[picks, 0].sum(-1).clamp(min=1)


def _percentile_interval(values: torch.Tensor, level: float) -> list[float]:
    tail = (1.0 - level) / 2
    return torch.quantile(values, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()


def _picks(num_questions: int, resamples: int, seed: int) -> torch.Tensor:
    """[R, Q] questions drawn with replacement, seeded: the same report each run."""
    return torch.randint(0, num_questions, (resamples, num_questions), generator=torch.Generator().manual_seed(seed))


def tau_interval(per_question: list[tuple[int, int]], level: float = 0.95, resamples: int = TAU_RESAMPLES,
                 seed: int = 0) -> list[float] | None:
    """[low, high]: the percentile bootstrap interval of tau = 1 + accepted / rounds over the questions (each
    question's (rounds, accepted) summed over its turns, resampled with replacement, pooled as tau pools them).
    Questions, not rounds, are the unit: rounds of one answer are not independent. None under two questions."""
    counts = [(r, a) for r, a in per_question if r > 0]
    if len(counts) < 2:
        return None
    return _percentile_interval(_resampled_taus(counts, _picks(len(counts), resamples, seed)), level)


def tau_difference_interval(first: list[tuple[int, int]], second: list[tuple[int, int]], level: float = 0.95,
                            resamples: int = TAU_RESAMPLES, seed: int = 0) -> list[float] | None:
    """[low, high]: the paired percentile bootstrap interval of tau(first) - tau(second) over the same questions
    (per question (rounds, accepted), in the same order): each resample draws questions once for both drafters, so
    what the questions share (their length, their difficulty) cancels and the interval is narrower than the two
    taus' own intervals suggest. None under two questions or when the lists differ in length."""
    if len(first) != len(second) or len(first) < 2:
        return None
    picks = _picks(len(first), resamples, seed)
    return _percentile_interval(_resampled_taus(first, picks) - _resampled_taus(second, picks), level)


def paired_tau_differences(records: list[dict], category: str = "all") -> list[dict]:
    """Each drafter's tau against the first drafter of its comparison group, paired over the questions both answered.

    A group is one dataset, temperature, batch size and k (a tree's budget apart) in `category`; the first drafter
    to appear in it is the base. Records without tau_per_question (the baseline, reports written before it existed)
    take no part. Two checkpoints may carry one name (two runs' final/: "eagle3:final"); within a group whose names
    repeat, each is named with its place in the group ("eagle3:final #2", the order of the --drafter list). Returns
    one dict per (group, other drafter): dataset, temperature, batch_size, num_draft_tokens, drafter, base,
    difference (tau - base tau, pooled over the shared questions), ci95 (`tau_difference_interval`) and questions
    (how many both answered)."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        if record["category"] == category and record.get("tau_per_question"):
            key = (record["dataset"], record["temperature"], record["batch_size"], str(record["num_draft_tokens"]),
                   record.get("tree_budget"))
            groups.setdefault(key, []).append(record)
    rows = []
    for (dataset, temperature, batch_size, _, _), group in groups.items():
        names = [record["drafter"] for record in group]
        if len(set(names)) < len(names):
            names = [f"{name} #{place}" for place, name in enumerate(names, 1)]
        base = group[0]
        base_counts = {q: (r, a) for q, r, a in base["tau_per_question"]}
        for name, record in zip(names[1:], group[1:]):
            counts = {q: (r, a) for q, r, a in record["tau_per_question"]}
            shared = sorted(set(counts) & set(base_counts))
            first, second = [counts[q] for q in shared], [base_counts[q] for q in shared]
            # no shared round reads tau 1 (nothing gained), as the pooled counts 0 / max(0, 1) always read here
            taus = [accept_length_mean(sum(r for r, _ in side), sum(a for _, a in side)) or 1.0
                    for side in (first, second)]
            rows.append({"dataset": dataset, "temperature": temperature, "batch_size": batch_size,
                         "num_draft_tokens": record["num_draft_tokens"], "drafter": name, "base": names[0],
                         "difference": taus[0] - taus[1],
                         "ci95": tau_difference_interval(first, second), "questions": len(shared)})
    return rows
