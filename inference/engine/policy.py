"""Width policies: how many drafts each round proposes (choose) and verifies (cut), one of the engine's two seams.

The loop (inference/engine/generate.py) calls, per generation and per round:

    policy.start(batch)                      # a new generation of `batch` rows
    width = policy.choose(active)            # before the round's drafts exist: 0..max_width (0 = a plain AR round)
    policy.keep_rows(rows)                   # finished rows left the batch
    num_valid = policy.cut(proposal, num_valid, active, draft_seconds)  # after the drafts exist: per-row lengths
    policy.observe(proposed, accepted)       # the round's outcome per row (host ints)

`choose` may read only earlier rounds, and `cut` only what the proposal knew before each draft was drawn (the
drafter's confidences), so every policy is lossless: conditioned on the history a round is an ordinary fixed-width
round. Policies: `FixedWidth(k)`, `AdaptiveK` (inference/engine/adaptive.py: expected throughput from running
acceptance estimates and measured costs) and `Scheduled(schedule, base)` (inference/engine/schedule.py: a base policy's
widths cut per row by a static threshold or the prefix scheduler).
"""

from __future__ import annotations

import torch

from inference.engine.schedule import scheduled_num_valid


class WidthPolicy:
    """The interface and its neutral defaults: propose max_width every round, verify everything proposed."""

    adaptive = False  # True when the widths are chosen at run time (the report's k = "auto")
    max_width = 0
    needs_timing = False  # True when `cut` weighs the drafter's measured seconds (the clock must run)

    def start(self, batch: int) -> None:
        pass

    def choose(self, active: torch.Tensor) -> int:
        return self.max_width

    def keep_rows(self, rows: torch.Tensor) -> None:
        pass

    def cut(self, proposal, num_valid: torch.Tensor, active: torch.Tensor, draft_seconds: float) -> torch.Tensor:
        return num_valid

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        pass


class FixedWidth(WidthPolicy):
    """k drafts every round (k = 0: plain autoregression through the same loop)."""

    def __init__(self, width: int):
        if width < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {width}")
        self.max_width = width


class Scheduled(WidthPolicy):
    """`base`'s widths, each row's proposal cut by `schedule` (StaticThreshold or PrefixScheduler) when the drafter
    gives confidences; a drafter without them proposes as under `base` alone."""

    needs_timing = True  # a schedule weighs draft seconds against verify seconds

    def __init__(self, schedule, base: WidthPolicy):
        self.schedule, self.base = schedule, base
        self.adaptive, self.max_width = base.adaptive, base.max_width

    def start(self, batch: int) -> None:
        self.base.start(batch)

    def choose(self, active: torch.Tensor) -> int:
        return self.base.choose(active)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.base.keep_rows(rows)

    def cut(self, proposal, num_valid: torch.Tensor, active: torch.Tensor, draft_seconds: float) -> torch.Tensor:
        num_valid = self.base.cut(proposal, num_valid, active, draft_seconds)
        return scheduled_num_valid(self.schedule, proposal, num_valid, active, draft_seconds)

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        self.base.observe(proposed, accepted)
