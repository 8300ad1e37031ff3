"""Adaptive proposal length: a width policy that chooses how many drafts each round proposes, k = 0 included.

    costs = profile_costs(target, drafter, prompts, max_width=7)          # inference/evaluation/profile.py, at start-up
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128,
                               adaptive=AdaptiveK(costs))

The design notes behind this module: docs/decisions.md, "inference/engine/adaptive.py".
"""

from __future__ import annotations

import math

import torch

from inference.engine.costs import CostProfile
from inference.engine.policy import WidthPolicy


def expected_gain(alpha: torch.Tensor) -> torch.Tensor:
    """alpha [R, K] conditional acceptance per position -> [R, K + 1] expected tokens per round at width 0..K:
    E(W) = 1 + sum_{j<=W} prod_{i<=j} alpha_i (the bonus token included, theory D.2)."""
    survival = alpha.cumprod(dim=-1)
    return torch.cat([torch.ones_like(alpha[:, :1]), 1.0 + survival.cumsum(dim=-1)], dim=-1)


def best_width(gain: torch.Tensor, round_seconds: torch.Tensor) -> int:
    """argmax_W gain[W] / round_seconds[W] over W = 0..K, ties to the smaller W. gain, round_seconds [K + 1]."""
    throughput = gain.double() / round_seconds.double()
    return int(torch.nonzero(throughput >= throughput.max() * (1 - 1e-12))[0])


class AdaptiveK(WidthPolicy):
    """Chooses the width of each round, 0..max_width (default: the costs' widest), from running acceptance
    estimates and a measured cost profile (module doc). A width policy (inference/engine/policy.py): the engine calls
    `start(batch)` once per generation, `choose(active)` before each round and `observe(...)` after it; one object
    serves successive generations (module doc: what carries over).
    """

    adaptive = True

    def __init__(self, costs: CostProfile, *, max_width: int | None = None, prior: float = 0.5,
                 prior_weight: float = 2.0, decay: float = 0.95, explore_after: int = 8, max_explore_after: int = 256,
                 explore_share: float = 0.02, regimes: bool = True):
        if not 0.0 <= prior <= 1.0 or prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"adaptive k: need prior in [0, 1], prior_weight > 0, decay in (0, 1]; got {prior}, "
                             f"{prior_weight}, {decay}")
        if not 1 <= explore_after <= max_explore_after or not 0.0 <= explore_share < 1.0:
            raise ValueError(f"adaptive k: need 1 <= explore_after <= max_explore_after and explore_share in [0, 1), "
                             f"got {explore_after}, {max_explore_after}, {explore_share}")
        max_width = costs.max_width if max_width is None else max_width
        if not 1 <= max_width <= costs.max_width:
            raise ValueError(f"adaptive k: max_width {max_width} must be in 1..{costs.max_width} (the profiled widths)")
        self.costs, self.max_width = costs, max_width
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        # the interval stops growing where a failed exploration costs explore_share of the AR time between two
        self.explore_after, self.max_explore_after = explore_after, max_explore_after
        if explore_share > 0:
            failed = costs.d(1) + costs.v(1) - costs.v(0)
            self.max_explore_after = min(max_explore_after, max(explore_after, math.ceil(
                failed / (explore_share * costs.v(0)))))
        self._seconds = costs.round_seconds()[: max_width + 1]
        self.num_regimes = 2 if regimes else 1
        # pooled (survived, offered) per regime and position, carried from one generation to the next
        self._carried = torch.zeros(2, self.num_regimes, self.max_width, dtype=torch.float64)
        self._interval = explore_after
        self._exploring = False
        # a drafter that proposes nothing (an n-gram miss) costs a round its draft seconds only: worth asking again
        self._retry_is_free = costs.d(1) <= 0.05 * costs.v(0)
        self.survived = self.offered = torch.zeros(0, self.num_regimes, self.max_width, dtype=torch.float64)
        self.regime = torch.zeros(0, dtype=torch.long)

    def start(self, batch: int) -> None:
        """A new generation of `batch` rows: each starts from the counts pooled over the rows of the previous
        generation (none for the first), so what was learnt about this drafter on this workload carries over."""
        if len(self.survived):
            self._carried = torch.stack([self.survived.mean(0), self.offered.mean(0)])
        self.survived = self._carried[0].repeat(batch, 1, 1)
        self.offered = self._carried[1].repeat(batch, 1, 1)
        self.regime = torch.zeros(batch, dtype=torch.long)
        self._zero_streak, self._exploring = 0, False

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the estimates of batch rows `rows` only (the engine dropped the others)."""
        rows = rows.cpu()
        self.survived, self.offered, self.regime = self.survived[rows], self.offered[rows], self.regime[rows]

    def acceptance(self) -> torch.Tensor:
        """[B, K] the current estimate of each row's conditional acceptance per position, in the row's regime."""
        rows = torch.arange(len(self.regime))
        survived, offered = self.survived[rows, self.regime], self.offered[rows, self.regime]
        alpha = torch.empty_like(survived)
        prior = torch.full_like(survived[:, 0], self.prior)
        for j in range(self.max_width):
            alpha[:, j] = (survived[:, j] + self.prior_weight * prior) / (offered[:, j] + self.prior_weight)
            prior = alpha[:, j]
        return alpha

    def choose(self, active: torch.Tensor) -> int:
        """The width of the next round. active [B] bool (host or device; read once per round)."""
        rows = active.detach().cpu().bool()
        gain = expected_gain(self.acceptance()[rows]).sum(dim=0)
        width = best_width(gain, self._seconds)
        if width > 0:
            self._zero_streak, self._interval, self._exploring = 0, self.explore_after, False
            return width
        if self._exploring:  # the last exploration saw nothing: the drafter proposed nothing
            if self._retry_is_free:
                return 1
            self._exploring, self._interval = False, min(2 * self._interval, self.max_explore_after)
        self._zero_streak += 1
        if self._zero_streak < self._interval:
            return 0
        self._zero_streak, self._exploring = 0, True
        return 1  # explore: one cheap round so a recovering drafter is seen again

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        """One round's outcome per row (host ints; rows that proposed nothing are left as they are)."""
        if self._exploring and any(p > 0 for p in proposed):  # an exploration that saw the drafter: ask less often
            self._exploring, self._interval = False, min(2 * self._interval, self.max_explore_after)
        for row, (num_proposed, num_accepted) in enumerate(zip(proposed, accepted)):
            if num_proposed <= 0:
                continue
            offered = min(num_accepted + 1, num_proposed)  # positions tested: the accepted ones and the first reject
            regime = int(self.regime[row])
            self.survived[row, regime, :offered] *= self.decay
            self.offered[row, regime, :offered] *= self.decay
            self.survived[row, regime, :num_accepted] += 1.0
            self.offered[row, regime, :offered] += 1.0
            if self.num_regimes > 1:  # the next round's regime: did this one accept every draft it proposed?
                self.regime[row] = int(num_accepted == num_proposed)
