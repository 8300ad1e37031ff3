"""Adaptive proposal length: the engine chooses how many drafts each round proposes, k = 0 included.

    costs = profile_costs(target, drafter, prompts, max_draft_tokens=7)       # once, at start-up
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128,
                               adaptive=AdaptiveK(costs))

Every round, before any draft of that round exists, `AdaptiveK.choose` picks the width W in 0..K maximising the
expected tokens per second sum_r E_r(W) / (d(W) + v(W)) (theory_and_metrics.md D.2): E_r(W) = 1 + sum_{j<=W}
prod_{i<=j} alpha_{r,i} is row r's expected gain, alpha_{r,j} its running estimate of the conditional acceptance at
position j, d(W) the drafter's seconds per round and v(W) the verify forward's, both measured on this machine at
each W (`profile_costs`: a chain drafter pays about W steps, a block drafter one forward whatever W). W = 0 is plain
autoregression, gain 1 per row at cost v(0). The choice reads only drafts of earlier rounds, so it is lossless:
conditioned on the history, a round is an ordinary fixed-k round.

Batch > 1: our engine pads every row to the round's width, so the verify of a round costs v(W) whatever each row
would have liked, and a draft inside a paid-for column costs nothing more; hence one W per round, chosen from the sum
of the rows' expected gains (rows that finished gain nothing and are left out).

What a k = 0 round still costs: nothing of the drafter. The engine defers the drafter's catch-up while rounds propose
nothing and hands the verified tokens over in one `commit` before the next proposal (drafters/base.py), so a drafter
whose drafts are always rejected costs a share of AR time bounded by the exploration below, not one drafter forward
per token.

Exploration: after `explore_after` rounds of W = 0 in a row, one round proposes W = 1 so a drafter that recovers is
found again; each exploration that does not end the streak doubles the interval up to `max_explore_after`, so over
N tokens a useless drafter costs about log2(max / min) + N / max explorations of d(1) + v(1) - v(0) each.

Estimator: per row and position, discounted counts (each observation multiplies the old ones by `decay`, a window of
about 1 / (1 - decay) rounds) with `prior_weight` pseudo-observations of a prior: `prior` at position 1, the estimate
of position j - 1 at position j (a position never proposed is assumed as good as the one before it, so a drafter
that keeps being accepted is tried one step deeper). Successive generations with one AdaptiveK (the requests of one
workload: `draftsmith eval` keeps one per drafter and batch size) carry the pooled counts of the previous one over to
every new row, and the exploration interval with them, so only the first request pays for learning that a drafter
is useless (measured: a fresh start per 32-token request proposed in 63 of 217 rounds with a random drafter).
"""

from __future__ import annotations

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
                 prior_weight: float = 2.0, decay: float = 0.95, explore_after: int = 8, max_explore_after: int = 256):
        if not 0.0 <= prior <= 1.0 or prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"adaptive k: need prior in [0, 1], prior_weight > 0, decay in (0, 1]; got {prior}, "
                             f"{prior_weight}, {decay}")
        if not 1 <= explore_after <= max_explore_after:
            raise ValueError(f"adaptive k: need 1 <= explore_after <= max_explore_after, got {explore_after}, "
                             f"{max_explore_after}")
        max_width = costs.max_width if max_width is None else max_width
        if not 1 <= max_width <= costs.max_width:
            raise ValueError(f"adaptive k: max_width {max_width} must be in 1..{costs.max_width} (the profiled widths)")
        self.costs, self.max_width = costs, max_width
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.explore_after, self.max_explore_after = explore_after, max_explore_after
        self._seconds = costs.round_seconds()[: max_width + 1]
        self._carried = torch.zeros(2, self.max_width, dtype=torch.float64)  # pooled (survived, offered) per position
        self._interval = explore_after
        self.survived = self.offered = torch.zeros(0, self.max_width, dtype=torch.float64)

    def start(self, batch: int) -> None:
        """A new generation of `batch` rows: each starts from the counts pooled over the rows of the previous
        generation (none for the first), so what was learnt about this drafter on this workload carries over."""
        if len(self.survived):
            self._carried = torch.stack([self.survived.mean(0), self.offered.mean(0)])
        self.survived = self._carried[0].repeat(batch, 1)
        self.offered = self._carried[1].repeat(batch, 1)
        self._zero_streak = 0

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the estimates of batch rows `rows` only (the engine dropped the others)."""
        rows = rows.cpu()
        self.survived, self.offered = self.survived[rows], self.offered[rows]

    def acceptance(self) -> torch.Tensor:
        """[B, K] the current estimate of each row's conditional acceptance per position."""
        alpha = torch.empty_like(self.survived)
        prior = torch.full_like(self.survived[:, 0], self.prior)
        for j in range(self.max_width):
            alpha[:, j] = (self.survived[:, j] + self.prior_weight * prior) / (self.offered[:, j] + self.prior_weight)
            prior = alpha[:, j]
        return alpha

    def choose(self, active: torch.Tensor) -> int:
        """The width of the next round. active [B] bool (host or device; read once per round)."""
        rows = active.detach().cpu().bool()
        gain = expected_gain(self.acceptance()[rows]).sum(dim=0)
        width = best_width(gain, self._seconds)
        if width > 0:
            self._zero_streak, self._interval = 0, self.explore_after
            return width
        self._zero_streak += 1
        if self._zero_streak < self._interval:
            return 0
        self._zero_streak, self._interval = 0, min(2 * self._interval, self.max_explore_after)
        return 1  # explore: one cheap round so a recovering drafter is seen again

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        """One round's outcome per row (host ints; rows that proposed nothing are left as they are)."""
        for row, (num_proposed, num_accepted) in enumerate(zip(proposed, accepted)):
            if num_proposed <= 0:
                continue
            offered = min(num_accepted + 1, num_proposed)  # positions tested: the accepted ones and the first reject
            self.survived[row, :offered] *= self.decay
            self.offered[row, :offered] *= self.decay
            self.survived[row, :num_accepted] += 1.0
            self.offered[row, :offered] += 1.0
