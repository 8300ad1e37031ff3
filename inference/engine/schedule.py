"""Confidence-scheduled verification: how many of its drafts each row of a batch sends to the target.

    costs = profile_costs(target, drafter, prompts, max_width=7)          # inference/evaluation/profile.py, at start-up
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128,
                               schedule=PrefixScheduler(costs))          # or StaticThreshold(0.5)

The design notes behind this module: docs/decisions.md, "inference/engine/schedule.py".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


def prefix_survival(confidence_logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} sigmoid(z_{r,i} / T_i): logits [R, K], temperatures [K] or None (T = 1) -> [R, K]."""
    logits = confidence_logits.double()
    if temperature is not None:
        logits = logits / temperature.to(logits.device, logits.dtype)[: logits.shape[1]]
    return torch.sigmoid(logits).cumprod(dim=-1)


def threshold_lengths(survival: torch.Tensor, threshold: float) -> torch.Tensor:
    """[R] drafts per row up to the first whose survival is below `threshold`."""
    return (survival >= threshold).long().cumprod(dim=-1).sum(dim=-1)


def prefix_schedule(survival: torch.Tensor, step_seconds, num_rows: int | None = None) -> torch.Tensor:
    """DSpark's greedy prefix scheduler with early stop, for an engine that pads every row to the round's width.

    Column by column (j = 1, 2, ...): admitting column j verifies draft j of every row still in (a row that
    offered it; survival 0 = not offered) and gains sum_r a_{r,j} tokens in expectation, at the cost of a verify
    forward over num_rows x (1 + j) tokens. Column j is admitted when that raises Theta = tau / step_seconds, and the
    search stops at the first column that does not. In a padded forward the drafts of an open column cost nothing
    more, so admitting them all is what the per-candidate greedy of the paper would do once the column is paid for;
    and admitting a column as a whole is what makes it payable at all: one candidate alone never covers a column's
    cost at batch > 1. At batch 1 this is exactly the paper's Algorithm 1. The decision for column j reads
    survivals of columns <= j only (which depend on drafts < j), so it never depends on draft j: lossless.

    Args:
        survival: [R, K] non-increasing along each row; 0 where a row offers no draft (finished, or past num_valid).
        step_seconds: callable, tokens read by the verify forward -> seconds of one engine round.
        num_rows: rows in the verify forward (default R); it reads num_rows x (1 + width) tokens.
    Returns:
        lengths [R] long: the admitted width, cut to the drafts each row offers.
    """
    rows, depth = survival.shape
    num_rows = rows if num_rows is None else num_rows
    columns = survival.detach().double().cpu()
    tau = float(rows)
    best = tau / step_seconds(num_rows)
    width = 0
    for j in range(depth):
        gain = float(columns[:, j].sum())
        if gain <= 0:
            break
        throughput = (tau + gain) / step_seconds(num_rows * (j + 2))
        if not throughput > best:
            break  # the first non-improvement ends the search (losslessness, see the module docstring)
        tau, best, width = tau + gain, throughput, j + 1
    offered = (columns > 0).long().cumprod(dim=-1).sum(dim=-1)
    return offered.clamp(max=width).to(survival.device)


@dataclass
class StaticThreshold:
    """Verify each row's drafts up to the first whose calibrated prefix survival is below `threshold`."""

    threshold: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"schedule threshold {self.threshold} must be in [0, 1]")

    def lengths(self, survival: torch.Tensor, calibrated: bool, num_rows: int, draft_seconds: float) -> torch.Tensor:
        return threshold_lengths(survival, self.threshold)

    @property
    def name(self) -> str:
        return f"threshold{self.threshold:g}"


@dataclass
class PrefixScheduler:
    """The hardware-aware prefix scheduler over a measured cost profile (inference/engine/costs.CostProfile, read
    through `verify_by_tokens`); uncalibrated drafters fall back to StaticThreshold(fallback_threshold) with a
    warning. cost None: not profiled yet (`draftsmith eval` gives each drafter's method its profile)."""

    cost: object
    fallback_threshold: float = 0.5
    _warned: bool = field(default=False, repr=False)

    def lengths(self, survival: torch.Tensor, calibrated: bool, num_rows: int, draft_seconds: float) -> torch.Tensor:
        if not calibrated:
            if not self._warned:
                warnings.warn(f"the drafter's confidences are not calibrated (run `draftsmith calibrate`); the prefix "
                              f"scheduler falls back to the static threshold {self.fallback_threshold}", stacklevel=2)
                self._warned = True
            return threshold_lengths(survival, self.fallback_threshold)
        if self.cost is None:
            raise ValueError("the prefix scheduler has no cost profile (inference/evaluation/profile.profile_costs)")
        return prefix_schedule(survival, lambda tokens: draft_seconds + self.cost.verify_by_tokens(tokens), num_rows)

    @property
    def name(self) -> str:
        return "scheduler"


def scheduled_num_valid(schedule, proposal, num_valid: torch.Tensor, active: torch.Tensor,
                        draft_seconds: float) -> torch.Tensor:
    """The engine's hook: num_valid [B] cut to the schedule's lengths when the proposal has confidences (a drafter
    without them proposes as it would unscheduled). draft_seconds: the drafter's mean time per round so far."""
    if proposal.confidence_logits is None:
        return num_valid
    logits = proposal.confidence_logits[:, : proposal.tokens.shape[1]].to(num_valid.device)
    survival = prefix_survival(logits, proposal.confidence_temperature)
    positions = torch.arange(survival.shape[1], device=survival.device)
    offered = (positions[None, :] < num_valid[:, None]) & active[:, None]
    survival = survival * offered  # drafts a row does not offer (or a finished row) are never admitted
    lengths = schedule.lengths(survival, proposal.confidence_temperature is not None, num_valid.shape[0],
                               draft_seconds)
    return torch.minimum(num_valid, lengths.to(num_valid.device))


# ---- command-line specs (draftsmith eval --schedule) -----------------------------------------------------------------
def parse_schedule_specs(text: str) -> list[str]:
    """"fixed,threshold:0.5,scheduler" -> the checked list; ValueError naming --schedule otherwise."""
    specs = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip())) or ["fixed"]
    for spec in specs:
        if spec in ("fixed", "scheduler"):
            continue
        name, _, value = spec.partition(":")
        try:
            ok = name == "threshold" and 0.0 <= float(value) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--schedule {spec!r}: use fixed, threshold:H with H in [0, 1], or scheduler")
    return specs


def build_schedules(specs: list[str]) -> list[tuple[str, object]]:
    """(name, schedule or None for fixed) per spec; "scheduler" gets its cost profile per drafter and batch size
    later (inference/evaluation/methods.Method.profiled)."""
    built = []
    for spec in specs:
        if spec == "fixed":
            built.append(("fixed", None))
        elif spec == "scheduler":
            built.append(("scheduler", PrefixScheduler(None)))
        else:
            schedule = StaticThreshold(float(spec.partition(":")[2]))
            built.append((schedule.name, schedule))
    return built
