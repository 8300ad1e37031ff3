"""Replay a width policy on a known greedy continuation: each round's proposal, acceptance and cost, no target run.

    result = replay(AdaptiveK(costs), NgramDrafter(NgramConfig(), info), prompt, continuation, costs)
    result.speedup                       # predicted over plain decoding, from costs.d(W) + costs.v(verified width)

Greedy speculative decoding emits the target's greedy continuation whatever the drafts, so once it is known (from
any greedy run) a round is fixed by the drafter's proposal at the current position: it accepts the longest prefix of
the proposal that matches the continuation, and the target adds the next token. For a drafter whose proposals
depend on the token history only (the n-gram drafter) a replay is exactly what the engine would do at batch 1,
with the costs of a profile in place of the clock: a deterministic way to compare width policies
(tests/test_adaptive.py, benchmarks/engine/auto_vs_fixed.py). The drafter's catch-up is committed every round (the engine
defers it over width-0 rounds; for history-only drafters the two are the same) and serves no target features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafters.base import DraftContext


@dataclass
class Replay:
    """tokens emitted; seconds they cost under the profile; per round the width chosen, drafts proposed and
    accepted; ar_seconds: what plain decoding of the same tokens costs (one v(0) per token)."""

    tokens: int = 0
    seconds: float = 0.0
    ar_seconds: float = 0.0
    chosen: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.ar_seconds / self.seconds


def replay(policy, drafter, prompt: list[int], continuation: list[int], costs, result: Replay | None = None) -> Replay:
    """One request at batch 1: prompt ids, then the target's greedy continuation (its first token comes from the
    prefill). Adds to `result` (several requests of one workload) and returns it."""
    result = result if result is not None else Replay()
    ids = torch.tensor([prompt])
    one = torch.ones(1, dtype=torch.bool)
    drafter.begin(DraftContext(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(len(prompt))[None], {},
                               next_tokens=torch.tensor(continuation[:1])))
    policy.start(1)
    position = 1  # continuation tokens emitted so far
    while position < len(continuation):
        width = min(policy.choose(one), len(continuation) - position)
        drafts: list[int] = []
        if width > 0:
            proposal = drafter.propose(width)
            offered = width if proposal.num_valid is None else min(int(proposal.num_valid[0]), width)
            drafts = proposal.tokens[0, :offered].tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == continuation[position + accepted]:
            accepted += 1
        emitted = min(accepted + 1, len(continuation) - position)
        result.seconds += costs.d(width) + costs.v(len(drafts))
        result.chosen.append(width)
        result.proposed.append(len(drafts))
        result.accepted.append(accepted)
        policy.observe([len(drafts)], [accepted])
        block = torch.tensor([[continuation[position - 1]] + drafts])
        steps = torch.arange(block.shape[1])
        drafter.commit(torch.tensor([accepted]), DraftContext(
            block, (steps <= accepted)[None], (len(prompt) + position - 1 + steps)[None], {},
            next_tokens=torch.tensor([continuation[position + accepted] if emitted > accepted else 0])))
        position += emitted
    result.tokens += len(continuation)
    result.ar_seconds += costs.v(0) * (len(continuation) - 1)  # the first token is the prefill's, as above
    return result
