"""Confidence-scheduled verification: how many of its drafts each row of a batch sends to the target.

    cost = profile_verify_cost(target, num_rows=4, max_width=8)          # once, at start-up
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128,
                               schedule=PrefixScheduler(cost))           # or StaticThreshold(0.5)

For any drafter whose Proposal carries confidence logits z_j (the estimate that draft j is accepted given that
drafts < j were; DSpark's confidence head) the prefix survival of row r at position j is
a_{r,j} = prod_{i<=j} sigmoid(z_{r,i} / T_i), with the drafter's calibration temperatures T (STS, `draftsmith
calibrate`; T = 1 when uncalibrated). Reference: algorithms_dflash_dspark.md 2.3 (DSpark Algorithm 1 and appendix A),
theory_and_metrics.md D.2-D.3.

- StaticThreshold(h): a row verifies its drafts up to the first whose survival falls below h.
- PrefixScheduler(cost): chooses the lengths l_r of all rows together to maximise the expected throughput
  Theta = tau / step_seconds, tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), step_seconds = the draft time of a round plus
  the verify cost of the forward the engine will run. Greedy admission by prefix survival, stopping at the FIRST
  admission that does not raise Theta (`prefix_schedule`; the paper's Algorithm 1 admits one (r, j) at a time in
  decreasing a_{r,j} over B = sum_r (1 + l_r) tokens; our engine pads rows to the round's width, so the unit it
  pays for is a column, see there). Stopping there is what keeps it lossless: a_{r,j} depends on the drafts before
  j only (the confidence head reads x_{j-1}, never x_j), so whether draft j is verified never depends on draft j
  itself. A look-ahead search over all lengths would: a high a_{r,j+1} (known only after x_j was drawn) can pull
  x_j into verification, and the output is then biased (appendix A; tests/test_schedule.py shows both).
  A drafter proposing without calibration falls back to StaticThreshold(fallback_threshold), and says so (a
  warning), since uncalibrated survivals are not probabilities to trade against seconds.
- The verify cost is a curve: seconds of one target verify forward by the number of tokens it reads. Our engine
  pads every row to the longest proposal of the round, so a round with lengths l reads num_rows x (1 + max l)
  tokens (the rows still running: finished rows leave the batch). `profile_verify_cost` measures it on this machine.
"""

from __future__ import annotations

import bisect
import time
import warnings
from dataclasses import dataclass, field

import torch

from inference.engine.target import synchronize


@dataclass(frozen=True)
class VerifyCost:
    """Seconds of one verify forward by the number of tokens it reads (rows x block width), linear in between and
    extrapolated from the last two points beyond the last."""

    num_tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if not self.num_tokens or len(self.num_tokens) != len(self.seconds):
            raise ValueError(f"verify cost curve: num_tokens ({len(self.num_tokens)} entries) and seconds "
                             f"({len(self.seconds)}) must be non-empty and of equal length")
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])) or self.num_tokens[0] < 1:
            raise ValueError(f"verify cost curve: num_tokens {list(self.num_tokens)} must increase from >= 1")
        bad = [(n, s) for n, s in zip(self.num_tokens, self.seconds) if not s > 0]
        if bad:
            raise ValueError(f"verify cost curve: seconds must be > 0; entries (num_tokens, seconds) {bad} are not")

    @classmethod
    def from_steps_per_second(cls, steps_per_second: dict[int, float]) -> "VerifyCost":
        """The paper's SPS(B) table (steps per second at B verified tokens) as a cost curve (seconds = 1 / SPS)."""
        bad = {n: s for n, s in steps_per_second.items() if not s > 0}
        if bad:
            raise ValueError(f"verify cost curve: steps per second must be > 0; entries {bad} are not")
        items = sorted(steps_per_second.items())
        return cls(tuple(n for n, _ in items), tuple(1.0 / s for _, s in items))

    def __call__(self, num_tokens: int) -> float:
        points, values = self.num_tokens, self.seconds
        if len(points) == 1:
            return values[0] * num_tokens / points[0]
        i = min(max(bisect.bisect_left(points, num_tokens), 1), len(points) - 1)
        x0, x1, y0, y1 = points[i - 1], points[i], values[i - 1], values[i]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), min(values))

    def to_dict(self) -> dict:
        return {"num_tokens": list(self.num_tokens), "seconds": list(self.seconds)}


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
    """The hardware-aware prefix scheduler over a measured verify-cost curve; uncalibrated drafters fall back to
    StaticThreshold(fallback_threshold) with a warning."""

    cost: VerifyCost
    fallback_threshold: float = 0.5
    _warned: bool = field(default=False, repr=False)

    def lengths(self, survival: torch.Tensor, calibrated: bool, num_rows: int, draft_seconds: float) -> torch.Tensor:
        if not calibrated:
            if not self._warned:
                warnings.warn(f"the drafter's confidences are not calibrated (run `draftsmith calibrate`); the prefix "
                              f"scheduler falls back to the static threshold {self.fallback_threshold}", stacklevel=2)
                self._warned = True
            return threshold_lengths(survival, self.fallback_threshold)
        return prefix_schedule(survival, lambda tokens: draft_seconds + self.cost(tokens), num_rows)

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


@torch.no_grad()
def profile_verify_cost(target, num_rows: int, max_width: int, context_tokens: int = 128,
                        repeats: int = 3) -> VerifyCost:
    """Measure the target's verify forward on this machine: [num_rows, w] blocks after a context of context_tokens,
    w = 1..max_width + 1, the median of `repeats` runs each (after one warm-up), rolled back every time.

    Returns:
        VerifyCost over num_tokens = num_rows x w.
    """
    if num_rows < 1 or max_width < 0 or context_tokens < 1 or repeats < 1:
        raise ValueError(f"profile_verify_cost: num_rows {num_rows}, max_width {max_width}, context_tokens "
                         f"{context_tokens} and repeats {repeats} must be positive")
    device = target.device
    vocab = target.target_info().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (num_rows, context_tokens), generator=generator).to(device)
    target.prefill(prompt, torch.ones_like(prompt))
    tokens, seconds = [], []
    for width in range(1, max_width + 2):
        block = torch.randint(0, vocab, (num_rows, width), generator=generator).to(device)
        times = []
        for attempt in range(repeats + 1):
            mark = target.mark()
            synchronize(device)
            start = time.perf_counter()
            target.extend(block)
            synchronize(device)
            elapsed = time.perf_counter() - start
            target.keep_after(mark, torch.zeros(num_rows, dtype=torch.long, device=device))
            if attempt:  # the first run warms up
                times.append(elapsed)
        tokens.append(num_rows * width)
        seconds.append(max(sorted(times)[len(times) // 2], 1e-9))
    return VerifyCost(tuple(tokens), tuple(seconds))


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


def build_schedules(specs: list[str], target, num_rows: int, max_width: int) -> list[tuple[str, object]]:
    """(name, schedule or None for fixed) per spec; "scheduler" profiles the verify cost once, here."""
    built = []
    for spec in specs:
        if spec == "fixed":
            built.append(("fixed", None))
        elif spec == "scheduler":
            cost = profile_verify_cost(target, num_rows, max_width)
            print(f"verify cost profiled on this machine (tokens: seconds): "
                  f"{dict(zip(cost.num_tokens, (round(s, 5) for s in cost.seconds)))}")
            built.append(("scheduler", PrefixScheduler(cost)))
        else:
            schedule = StaticThreshold(float(spec.partition(":")[2]))
            built.append((schedule.name, schedule))
    return built
