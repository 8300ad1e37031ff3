"""The speculative decoding loop: draft, verify in one target forward, accept left to right, roll back.

    out = decode(target, drafter, prompts, ChainRounds(), AdaptiveK(costs), max_new_tokens=128)
    out = decode(target, drafter, prompts, TreeRounds(4), FixedWidth(15), max_new_tokens=128,
                 sampling=Sampling(temperature=0.7, seed=1))

The facades users call (speculative_generate, tree_speculative_generate) build these arguments in
inference/engine/api.py.

One loop with two seams. A round strategy (inference/engine/rounds.py: `ChainRounds`; tree/rounds.py: `TreeRounds`)
says how a round's drafts are laid out, verified and committed; a width policy (inference/engine/policy.py:
`FixedWidth`, adaptive.AdaptiveK, policy.Scheduled over schedule.py's StaticThreshold / PrefixScheduler) says how
many drafts each round proposes (choose, before the drafts exist) and verifies (cut, per row, after). The target
(inference/engine/target.TargetModel) owns its cache: rollback, row dropping and position ids.

Batch size >= 1 with per-row acceptance, EOS and max-new-tokens per row, greedy and lossless sampling
(inference/engine/verify.py). `drafter=None` or width 0 is plain autoregression through the same code: one target
forward per token, the fair baseline for speedup. Rows that finished leave the batch (`drop_finished_rows`, where
the strategy and the drafter allow it): the target and the drafter keep only the running rows (drafters/base.py
keep_rows), so a batch whose rows end early costs what its remaining rows cost.
"""

from __future__ import annotations

import torch

from drafters.base import Drafter
from inference.engine.policy import WidthPolicy
from inference.engine.run import GenerateOutput, Run
from inference.engine.verify import GREEDY, Sampling

__all__ = ["GenerateOutput", "decode"]


@torch.no_grad()
def decode(target, drafter: Drafter | None, prompts: list[list[int]], rounds, policy: WidthPolicy, *,
           max_new_tokens: int, sampling: Sampling = GREEDY, eos_token_ids=None, drop_finished_rows: bool = True,
           timed: bool = True) -> GenerateOutput:
    """Generate up to max_new_tokens per prompt with round strategy `rounds` and width policy `policy`.
    drop_finished_rows=False keeps finished rows in the batch to the end (masked out), as a reference.
    timed=False: no device synchronisation for the phase clock (the time_* fields stay 0), unless the policy
    reads the clock (`needs_timing`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    run = Run(target, drafter, policy, sampling, eos_token_ids=eos_token_ids, max_new_tokens=max_new_tokens,
              timed=timed)
    run.start(prompts, rounds)
    while any(run.running):  # the active rows, read on the host
        width = policy.choose(torch.tensor(run.running))  # earlier rounds only (lossless); a host tensor: no sync
        run.drop_finished(rounds, drop_finished_rows)
        draft = rounds.draft(run, width)
        verdict = run.clock.run("verify", rounds.verify, run, draft)
        run.out.target_forwards += 1
        run.out.verify_forwards += 1
        if run.drafting:
            run.record(draft, verdict)
        was_active = run.active
        run.emit(verdict.drafts, verdict.num_accepted, verdict.new_tokens)
        run.next_tokens = verdict.new_tokens
        if run.drafting:
            rounds.commit(run, draft, verdict, was_active)
    return run.finish()

