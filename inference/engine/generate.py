"""The speculative decoding loop: draft, verify in one target forward, accept left to right, roll back.

    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128)
    out = decode(target, drafter, prompts, ChainRounds(), AdaptiveK(costs), max_new_tokens=128)   # the same loop

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
from inference.engine.policy import FixedWidth, Scheduled, WidthPolicy
from inference.engine.rounds import ChainRounds
from inference.engine.run import GenerateOutput, Run
from inference.engine.tree.draft import check_budget
from inference.engine.tree.rounds import TreeRounds

__all__ = ["GenerateOutput", "decode", "speculative_generate", "tree_speculative_generate"]


@torch.no_grad()
def decode(target, drafter: Drafter | None, prompts: list[list[int]], rounds, policy: WidthPolicy, *,
           max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
           eos_token_ids=None, drop_finished_rows: bool = True, timed: bool = True) -> GenerateOutput:
    """Generate up to max_new_tokens per prompt with round strategy `rounds` and width policy `policy`.
    drop_finished_rows=False keeps finished rows in the batch to the end (masked out), as a reference.
    timed=False: no device synchronisation for the phase clock (the time_* fields stay 0), unless the policy
    reads the clock (`needs_timing`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    run = Run(target, drafter, policy, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
              eos_token_ids=eos_token_ids, max_new_tokens=max_new_tokens, timed=timed)
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


def speculative_generate(target, drafter: Drafter | None, prompts: list[list[int]], *, num_draft_tokens: int,
                         max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         seed: int = 0, eos_token_ids=None, schedule=None, adaptive: WidthPolicy | None = None,
                         drop_finished_rows: bool = True) -> GenerateOutput:
    """Chain rounds of num_draft_tokens drafts (target: an inference.engine.target.TargetModel). `adaptive`: a width
    policy choosing each round's width in 0..num_draft_tokens (adaptive.AdaptiveK; None = k every round);
    `schedule`: schedule.StaticThreshold or PrefixScheduler cutting each row's proposal by its confidences."""
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if adaptive is not None and adaptive.max_width != num_draft_tokens:
        raise ValueError(f"adaptive k: it chooses widths up to {adaptive.max_width}, num_draft_tokens is "
                         f"{num_draft_tokens}")
    width = num_draft_tokens if drafter is not None else 0
    policy = adaptive if adaptive is not None and width > 0 else FixedWidth(width)
    if schedule is not None and width > 0:
        policy = Scheduled(schedule, policy)
    return decode(target, drafter if width else None, prompts, ChainRounds(), policy, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, eos_token_ids=eos_token_ids,
                  drop_finished_rows=drop_finished_rows)


def tree_speculative_generate(target, drafter: Drafter | None, prompts: list[list[int]], *, tree_budget: int,
                              max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                              seed: int = 0, eos_token_ids=None, tree_top_k: int = 4) -> GenerateOutput:
    """Tree rounds of tree_budget nodes (root included; 1 = plain autoregression). tree_top_k: children per
    expanded node and frontier width of EAGLE-2 trees (inference/engine/tree/rounds.py)."""
    check_budget(tree_budget)
    return decode(target, drafter if tree_budget > 1 else None, prompts, TreeRounds(tree_top_k),
                  FixedWidth(tree_budget - 1), max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                  top_k=top_k, seed=seed, eos_token_ids=eos_token_ids)
