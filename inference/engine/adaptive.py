"""Adaptive proposal length: a width policy that chooses how many drafts each round proposes, k = 0 included.

    costs = profile_costs(target, drafter, prompts, max_width=7)          # inference/engine/costs.py, at start-up
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128,
                               adaptive=AdaptiveK(costs))

Every round, before any draft of that round exists, `AdaptiveK.choose` picks the width W in 0..K maximising the
expected tokens per second sum_r E_r(W) / (d(W) + v(W)) (theory_and_metrics.md D.2): E_r(W) = 1 + sum_{j<=W}
prod_{i<=j} alpha_{r,i} is row r's expected gain, alpha_{r,j} its running estimate of the conditional acceptance at
position j, d(W) the drafter's seconds per round and v(W) the verify forward's over W + 1 tokens per row, both
measured on this machine (`profile_costs`). W = 0 is plain autoregression, gain 1 per row at cost v(0). The choice
reads only earlier rounds, so it is lossless: conditioned on the history, a round is an ordinary fixed-k round.

Batch > 1: our engine pads every row to the round's width, so the verify of a round costs v(W) whatever each row
would have liked, and a draft inside a paid-for column costs nothing more; hence one W per round, chosen from the sum
of the rows' expected gains (rows that finished gain nothing and are left out).

A drafter that proposes fewer drafts than asked (the n-gram drafter proposes nothing on a miss) makes a round cheaper,
not dearer: the verify reads what was proposed. alpha is conditional on a draft being proposed (rounds that proposed
nothing are not observed), and with d(W) ~ 0 the choice between W = 0 and W > 0 is then the same as if every round
proposed. What matters is that v(W) is the price of W drafts really verified, which `profile_costs` measures on full
blocks.

What a k = 0 round still costs: nothing of the drafter. The engine defers the drafter's catch-up while rounds propose
nothing and hands the verified tokens over in one `commit` before the next proposal (drafters/base.py), so a drafter
whose drafts are always rejected costs a share of AR time bounded by the exploration below.

Exploration: after `explore_after` rounds of W = 0 in a row, one round proposes W = 1 so a drafter that recovers is
found again; each exploration that does not end the streak doubles the interval, up to `max_explore_after` or the
interval at which a rejected exploration (d(1) + v(1) - v(0)) costs `explore_share` of the AR time between two,
whichever is smaller: a useless drafter costs at most about that share, and a drafter whose good runs come and go
is looked at again within a run's length where exploring is cheap. An
exploration the drafter answered with nothing saw nothing: when such a round costs under 5% of an AR step (d(1)
small: the n-gram drafter) the next round asks again, otherwise it counts as done.

Estimator: per row, regime and position, discounted counts (each observation multiplies the old ones by `decay`, a
window of about 1 / (1 - decay) rounds) with `prior_weight` pseudo-observations of a prior: `prior` at position 1,
the estimate of position j - 1 at position j (a position never proposed is assumed as good as the one before it, so
a drafter that keeps being accepted is tried one step deeper). Regimes (`regimes=True`): a row whose last proposing
round accepted every draft reads and updates counts kept for such rounds only, any other row the rest. A stationary
drafter's two estimates converge to the same values; a drafter whose acceptance comes in runs (the n-gram drafter
inside and outside copied text) gets the acceptance of the regime it is in instead of an average that is wrong in
both. Successive generations with one AdaptiveK (the requests of one workload: `draftsmith eval` keeps one per
drafter and batch size) carry the pooled counts of the previous one over to every new row, and the exploration
interval with them, so only the first request pays for learning that a drafter is useless.
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
