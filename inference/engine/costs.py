"""What an engine round costs on this machine: one profile, measured once at start-up, read by every width policy.

    costs = profile_costs(target, drafter, prompts, max_width=7)          # inference/evaluation/profile.py
    costs.d(3), costs.v(3)                                                # seconds: draft and verify of a W = 3 round
    costs.verify_by_tokens(12)                                            # seconds of a verify forward over 12 tokens

d(W) is the drafter's propose + commit per round (0 at W = 0: its catch-up is deferred), v(W) the target's verify
forward over W + 1 tokens per row with the accept decision and the rollback, both at `num_rows` rows (the batch the
profile ran; `profile_costs` says how each is measured). `AdaptiveK` maximises expected tokens / (d(W) + v(W));
the prefix scheduler reads the verify cost by the number of tokens a forward reads (rows x width, linear in
between), so both decide from the same measurement. Another measurement (a roofline, achieved GB/s) is one more
field here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CostProfile:
    """Seconds per engine round at each width W = 0..K for one drafter at `num_rows` rows.

    draft_seconds[W]: the drafter's propose + commit per round (0 at W = 0).
    verify_seconds[W]: one verify forward over num_rows x (W + 1) tokens, accept/reject and rollback included.
    """

    draft_seconds: tuple[float, ...]
    verify_seconds: tuple[float, ...]
    num_rows: int = 1

    def __post_init__(self):
        if len(self.draft_seconds) != len(self.verify_seconds) or len(self.verify_seconds) < 2:
            raise ValueError(f"cost curves: draft_seconds ({len(self.draft_seconds)}) and verify_seconds "
                             f"({len(self.verify_seconds)}) must have one entry per width 0..K with K >= 1")
        bad = [(w, s) for w, s in enumerate(self.verify_seconds) if not s > 0]
        if bad or any(s < 0 for s in self.draft_seconds):
            raise ValueError(f"cost curves: verify seconds must be > 0 and draft seconds >= 0; entries (width, "
                             f"verify seconds) {bad} are not")
        if self.num_rows < 1:
            raise ValueError(f"cost curves: num_rows must be >= 1, got {self.num_rows}")

    @classmethod
    def from_steps_per_second(cls, steps_per_second: dict[int, float]) -> "CostProfile":
        """A paper's SPS(B) table (verify steps per second at B = 1, 2, ... verified tokens, one row) as a profile
        with free drafts: v(W) = 1 / SPS(W + 1)."""
        bad = {n: s for n, s in steps_per_second.items() if not s > 0}
        if bad:
            raise ValueError(f"cost curves: steps per second must be > 0; entries {bad} are not")
        if sorted(steps_per_second) != list(range(1, len(steps_per_second) + 1)):
            raise ValueError(f"cost curves: steps per second need every B = 1..N, got {sorted(steps_per_second)}")
        verify = tuple(1.0 / steps_per_second[n] for n in sorted(steps_per_second))
        return cls((0.0,) * len(verify), verify)

    @property
    def max_width(self) -> int:
        return len(self.verify_seconds) - 1

    def d(self, width: int) -> float:
        return self.draft_seconds[width]

    def v(self, width: int) -> float:
        return self.verify_seconds[width]

    def round_seconds(self) -> torch.Tensor:
        """[K + 1] d(W) + v(W)."""
        return (torch.tensor(self.draft_seconds, dtype=torch.float64)
                + torch.tensor(self.verify_seconds, dtype=torch.float64))

    def verify_by_tokens(self, num_tokens: int) -> float:
        """Seconds of a verify forward reading num_tokens tokens (any rows x width): linear between the profiled
        points num_rows x (W + 1), extrapolated from the last two beyond them, never under the cheapest."""
        points = [self.num_rows * (w + 1) for w in range(self.max_width + 1)]
        values = self.verify_seconds
        i = min(max(bisect.bisect_left(points, num_tokens), 1), len(points) - 1)
        x0, x1, y0, y1 = points[i - 1], points[i], values[i - 1], values[i]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), min(values))

    def in_ar_steps(self) -> dict:
        """d(W) and v(W) in AR steps (v(0) = 1), the units of the report (inference/evaluation/metrics.py)."""
        step = self.verify_seconds[0]
        return {"d": [s / step for s in self.draft_seconds], "v": [s / step for s in self.verify_seconds]}

    def to_dict(self) -> dict:
        return {"draft_seconds": list(self.draft_seconds), "verify_seconds": list(self.verify_seconds),
                "num_rows": self.num_rows, **self.in_ar_steps()}
